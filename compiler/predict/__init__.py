"""Predictions of how a plan runs: the discrete-event simulator, per-rank memory, Chrome
traces and the timeline picture, and the `tpc simulate` report."""
