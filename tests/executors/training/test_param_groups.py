import torch

from tests.executors.training.models.tiny_gpt import model as tiny_model
from tpc.executors.training.param_groups import adamw_groups, build_optimizer, set_lr
from tpc.ir.diagnostics import TpirError
import pytest


def test_decay_on_matrices_only_sorted_by_name():
    net = tiny_model()
    groups = adamw_groups(net.named_parameters(), 0.1)
    decay, no_decay = groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert decay["names"] == sorted(decay["names"]) and no_decay["names"] == sorted(no_decay["names"])
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert "h.0.qkv.weight" in decay["names"] and "wpe.weight" in decay["names"]
    assert "h.0.qkv.bias" in no_decay["names"] and "ln_f.weight" in no_decay["names"]
    # the tied embedding / head is one tensor: listed once
    all_params = decay["params"] + no_decay["params"]
    assert len({id(p) for p in all_params}) == len(all_params) == len(list(net.parameters()))


def test_order_does_not_depend_on_registration_order():
    net = tiny_model()
    fwd = adamw_groups(net.named_parameters(), 0.1)
    rev = adamw_groups(list(net.named_parameters())[::-1], 0.1)
    assert [g["names"] for g in fwd] == [g["names"] for g in rev]


def test_frozen_parameters_and_empty_groups_are_left_out():
    lin = torch.nn.Linear(3, 3, bias=False)
    groups = adamw_groups(lin.named_parameters(), 0.1)
    assert len(groups) == 1 and groups[0]["names"] == ["weight"]
    lin.weight.requires_grad_(False)
    assert adamw_groups(lin.named_parameters(), 0.1) == []


def test_adamw_decays_matrices_but_not_biases():
    lin = torch.nn.Linear(2, 2)
    with torch.no_grad():
        lin.weight.fill_(1.0)
        lin.bias.fill_(1.0)
    opt = build_optimizer("adamw", lin.named_parameters(), lr=0.5, weight_decay=0.1)
    for p in lin.parameters():
        p.grad = torch.zeros_like(p)  # only weight decay moves anything
    opt.step()
    assert torch.allclose(lin.weight, torch.full((2, 2), 1.0 - 0.5 * 0.1))
    assert torch.equal(lin.bias, torch.ones(2))


def test_sgd_and_set_lr():
    lin = torch.nn.Linear(2, 2)
    opt = build_optimizer("sgd", lin.named_parameters(), lr=0.1, weight_decay=0.1)
    assert isinstance(opt, torch.optim.SGD)
    set_lr(opt, 0.25)
    before = lin.weight.detach().clone()
    for p in lin.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert torch.allclose(lin.weight, before - 0.25)


def test_split_model_steps_like_the_whole_model():
    torch.manual_seed(0)
    whole = tiny_model()
    split = tiny_model()
    split.load_state_dict(whole.state_dict())
    x = torch.randint(0, 256, (2, 8))
    for net in (whole, split):
        net(x).square().mean().backward()
    opt_whole = build_optimizer("adamw", whole.named_parameters(), 1e-2, 0.1)
    names = [n for n, _ in split.named_parameters()]
    half = len(names) // 2
    params = dict(split.named_parameters())
    opts = [build_optimizer("adamw", [(n, params[n]) for n in part], 1e-2, 0.1) for part in (names[:half], names[half:])]
    opt_whole.step()
    for o in opts:
        o.step()
    for (n, a), (_, b) in zip(whole.named_parameters(), split.named_parameters()):
        assert torch.equal(a, b), n


def test_bad_kind_is_refused():
    with pytest.raises(TpirError, match="unknown optimizer"):
        build_optimizer("lamb", torch.nn.Linear(2, 2).named_parameters(), 0.1, 0.0)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_foreach_kernels_step_bit_identical_to_the_per_parameter_loop(kind):
    """build_optimizer uses foreach (multi-tensor) kernels; each element gets the per-parameter
    loop's arithmetic: a rank's half of the model after 4 steps equals, bit for bit, the whole
    model stepped by torch's foreach=False optimizer."""
    torch.manual_seed(0)
    shapes = {"a.weight": (7, 5), "a.bias": (5,), "b.weight": (11, 3), "b.norm": (3,)}
    ours = {n: torch.nn.Parameter(torch.randn(s)) for n, s in shapes.items()}
    ref = {n: torch.nn.Parameter(p.detach().clone()) for n, p in ours.items()}
    halves = [build_optimizer(kind, [(n, ours[n]) for n in names], 1e-2, 0.1)
              for names in (("a.weight", "a.bias"), ("b.weight", "b.norm"))]
    assert all(g["foreach"] for o in halves for g in o.param_groups)
    if kind == "sgd":
        whole = torch.optim.SGD(list(ref.values()), lr=1e-2, foreach=False)
    else:
        decay = [ref[n] for n in shapes if n.endswith("weight")]
        rest = [ref[n] for n in shapes if not n.endswith("weight")]
        whole = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": rest, "weight_decay": 0.0}],
                                  lr=1e-2, betas=(0.9, 0.95), foreach=False)
    for _ in range(4):
        grads = {n: torch.randn(s) for n, s in shapes.items()}
        for n in shapes:
            ours[n].grad, ref[n].grad = grads[n].clone(), grads[n].clone()
        for o in halves:
            o.step()
        whole.step()
    for n in shapes:
        assert torch.equal(ours[n], ref[n]), n


def test_groups_are_bounded_in_bytes_and_step_as_one_group_would(monkeypatch):
    """AdamW's multi-tensor temporaries are made per group: groups of at most GROUP_BYTES keep
    them small, and every element gets the same arithmetic as in one group."""
    from tpc.executors.training import param_groups

    torch.manual_seed(0)
    net = tiny_model()
    names = [n for n, p in net.named_parameters() if p.dim() >= 2]
    biggest = max(p.numel() * 4 for n, p in net.named_parameters())
    monkeypatch.setattr(param_groups, "GROUP_BYTES", biggest)
    cut = adamw_groups(net.named_parameters(), 0.1)
    assert len(cut) > 2
    assert all(sum(p.numel() * 4 for p in g["params"]) <= biggest for g in cut)
    assert [n for g in cut if g["weight_decay"] == 0.1 for n in g["names"]] == sorted(names)

    whole = tiny_model()
    whole.load_state_dict(net.state_dict())
    opts = [build_optimizer("adamw", net.named_parameters(), 1e-2, 0.1)]
    monkeypatch.setattr(param_groups, "GROUP_BYTES", 1 << 40)
    opts.append(build_optimizer("adamw", whole.named_parameters(), 1e-2, 0.1))
    assert len(opts[0].param_groups) > len(opts[1].param_groups) == 2
    for _ in range(3):
        for m, opt in zip((net, whole), opts):
            torch.manual_seed(1)
            for p in m.parameters():
                p.grad = torch.randn_like(p)
            opt.step()
    for (n, a), (_, b) in zip(net.named_parameters(), whole.named_parameters()):
        assert torch.equal(a, b), n
