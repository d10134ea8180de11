import math

import torch

from tests.executors.training.models.tiny_gpt import model as tiny_model
from tpc.executors.training.clip import apply_clip, clip_coef, clip_global, grad_norm, local_sq_norm, copies_not_owned
from tpc.ir.nodes import Header, MeshLine, Microbatch, ModelLine, ScheduleLine, ShapeLine, Stage, Tie, UnitsLine


def _model_with_grads(seed=0, scale=1.0):
    torch.manual_seed(seed)
    net = tiny_model()
    x = torch.randint(0, 256, (2, 8))
    (net(x).square().mean() * scale).backward()
    return net


def _copy(net):
    other = tiny_model()
    other.load_state_dict(net.state_dict())
    for a, b in zip(net.parameters(), other.parameters()):
        b.grad = a.grad.clone()
    return other


def test_two_rank_split_clips_like_clip_grad_norm():
    ref = _model_with_grads(scale=1e3)
    mine = _copy(ref)
    total_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.5)

    # two "ranks" as name sets; the tied head/embedding appears in both, rank 1 skips it
    named = list(mine.named_parameters(remove_duplicate=False))
    rank0 = [(n, p) for n, p in named if n.startswith(("wte", "wpe", "h.0"))]
    rank1 = [(n, p) for n, p in named if not n.startswith(("wpe", "h.0"))]  # holds wte too (tie copy)
    tied_names = {"wte.weight", "lm_head.weight"}
    assert tied_names <= {n for n, _ in rank1} and "wte.weight" in {n for n, _ in rank0}
    total = local_sq_norm(rank0) + local_sq_norm(rank1, skip=tied_names)
    assert math.isclose(grad_norm(total), float(total_ref), rel_tol=1e-6)
    coef = clip_coef(total, 0.5)
    assert coef < 1.0
    apply_clip([p for _, p in rank0], coef)
    apply_clip([p for n, p in rank1 if n not in tied_names], coef)  # rank 0 owns the tie
    for (n, a), b in zip(ref.named_parameters(), mine.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-6, atol=0), n


def test_norm_below_threshold_or_clip_off_leaves_gradients():
    net = _model_with_grads()
    total = local_sq_norm(net.named_parameters())
    assert clip_coef(total, 0.0) == 1.0
    assert clip_coef(total, grad_norm(total) * 2) == 1.0
    before = [p.grad.clone() for p in net.parameters()]
    apply_clip(net.parameters(), clip_coef(total, grad_norm(total) * 2))
    assert all(torch.equal(a, p.grad) for a, p in zip(before, net.parameters()))


def test_missing_grads_and_duplicates_count_once():
    p = torch.nn.Parameter(torch.zeros(3))
    q = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    total = local_sq_norm([("a", p), ("a_alias", p), ("b", q)])
    assert float(total) == 25.0
    apply_clip([p, p], 0.5)
    assert torch.equal(p.grad, torch.tensor([1.5, 2.0, 0.0]))


def test_non_finite_norm_propagates():
    assert math.isnan(clip_coef(float("nan"), 1.0))


def test_clip_global_with_a_summing_callback_matches_clip_grad_norm():
    ref = _model_with_grads(scale=1e3)
    mine = _copy(ref)
    total_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.5)
    named = list(mine.named_parameters(remove_duplicate=False))
    ranks = [[(n, p) for n, p in named if n.startswith(("wte", "wpe", "h.0"))],
             [(n, p) for n, p in named if not n.startswith(("wte", "wpe", "h.0"))]]
    skips = [frozenset(), frozenset({"wte.weight", "lm_head.weight"})]
    shares = [local_sq_norm(r, s) for r, s in zip(ranks, skips)]
    # what an all_reduce over the pipeline group returns: every rank's share summed. Here the two
    # "ranks" share one tied tensor (real ranks hold copies), so rank 1 must not scale it again.
    # clip_global returns the summed squares (on the device); the norm is their root on the host
    norms = [grad_norm(clip_global(r if i == 0 else [(n, p) for n, p in r if n not in skips[1]], 0.5,
                                   skip=skips[i], sum_over_pipeline=lambda _: shares[0] + shares[1]))
             for i, r in enumerate(ranks)]
    assert norms[0] == norms[1] and math.isclose(norms[0], float(total_ref), rel_tol=1e-6)
    for (n, a), b in zip(ref.named_parameters(), mine.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-6, atol=0), n


def test_tie_is_counted_by_the_rank_of_its_first_stage():
    header = Header(
        model=ModelLine("m.py", "0" * 64), shape=ShapeLine(batch=1, seq=4, vocab=8), mesh=MeshLine(pipe=3),
        schedule=ScheduleLine("gpipe"), units=UnitsLine(4),
        stages=(Stage(0, 0, (0, 1)), Stage(1, 1, (1, 2)), Stage(2, 2, (2, 3)), Stage(3, 0, (3, 4))),
        microbatches=(Microbatch(0, 1, ((0, 4),)),),
        ties=(Tie("wte.weight", (0, 2)), Tie("x.weight", (0, 3))))
    assert copies_not_owned(header, 0) == frozenset()  # owns both; x is one object on rank 0
    assert copies_not_owned(header, 1) == frozenset()  # holds no tie
    assert copies_not_owned(header, 2) == frozenset({"wte.weight"})


def test_a_replicated_stage_is_counted_by_its_replica_0s_rank():
    """Chimera: stage 0 on ranks 0 (replica 0) and 1, stage 1 on ranks 1 (replica 0) and 0."""
    header = Header(
        model=ModelLine("m.py", "0" * 64), shape=ShapeLine(batch=2, seq=4, vocab=8), mesh=MeshLine(pipe=2),
        schedule=ScheduleLine("chimera"), units=UnitsLine(2),
        stages=(Stage(0, 0, (0, 1), replicas=(1,)), Stage(1, 1, (1, 2), replicas=(0,))),
        microbatches=(Microbatch(0, 1, ((0, 4),)), Microbatch(1, 1, ((0, 4),), replica=1)))
    names = {0: ["wte.weight", "h.0.w"], 1: ["h.1.w", "head.weight"]}
    assert copies_not_owned(header, 0, names) == frozenset({"h.1.w", "head.weight"})
    assert copies_not_owned(header, 1, names) == frozenset({"wte.weight", "h.0.w"})


def test_a_tie_of_replicated_stages_is_counted_once():
    """Chimera on GPT-2: stages 0 and 1 tie "wte.weight", and both ranks hold a replica of both
    stages. Rank 0 (replica 0 of stage 0) counts the tie; rank 1 skips it and the rest of its
    stage-0 copy, rank 0 the rest of its stage-1 copy."""
    header = Header(
        model=ModelLine("m.py", "0" * 64), shape=ShapeLine(batch=2, seq=4, vocab=8), mesh=MeshLine(pipe=2),
        schedule=ScheduleLine("chimera"), units=UnitsLine(2),
        stages=(Stage(0, 0, (0, 1), replicas=(1,)), Stage(1, 1, (1, 2), replicas=(0,))),
        ties=(Tie("wte.weight", (0, 1)),),
        microbatches=(Microbatch(0, 1, ((0, 4),)), Microbatch(1, 1, ((0, 4),), replica=1)))
    names = {0: ["wte.weight", "h.0.w"], 1: ["h.1.w", "wte.weight"]}
    assert copies_not_owned(header, 0, names) == frozenset({"h.1.w"})
    assert copies_not_owned(header, 1, names) == frozenset({"wte.weight", "h.0.w"})
