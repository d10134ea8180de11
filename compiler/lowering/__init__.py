"""Lowering: a per-rank compute order becomes a complete plan (loads, messages, exchanges,
reductions, step), recomputation, and the plan's evaluation program."""
