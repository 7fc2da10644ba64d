"""Muon + AdamW and the LR schedule."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xtrain.optim import MuonAdamW, lr_multiplier, orthogonalize


def test_schedule_warmup_constant_warmdown():
    sched = dict(max_steps=100, warmup_steps=10, warmdown_ratio=0.2, final_lr_frac=0.1)
    values = [float(lr_multiplier(s, **sched)) for s in range(100)]
    assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)  # (s+1)/10
    assert all(v == 1.0 for v in values[10:80])
    assert values[90] == pytest.approx(0.5 * 1 + 0.5 * 0.1)  # halfway down: (100-90)/20 = 0.5
    assert values[99] == pytest.approx(0.05 + 0.95 * 0.1)
    assert all(a >= b for a, b in zip(values[80:], values[81:]))  # monotone down


def test_schedule_is_the_same_on_tensors_and_numbers():
    sched = dict(max_steps=50, warmup_steps=5, warmdown_ratio=0.5, final_lr_frac=0.0)
    steps = torch.arange(50, dtype=torch.float32)
    assert torch.allclose(lr_multiplier(steps, **sched),
                          torch.tensor([float(lr_multiplier(int(s), **sched)) for s in steps]))


def test_newton_schulz_orthogonalizes():
    G = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    X = orthogonalize(G, steps=5)
    singular = torch.linalg.svdvals(X)
    # quintic NS drives every singular value into roughly [0.7, 1.2] (not exactly 1, by design)
    assert singular.min() > 0.6 and singular.max() < 1.3
    assert X.shape == G.shape


def _toy():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 8))
    e = torch.nn.Parameter(torch.randn(10, 8))
    opt = MuonAdamW([dict(params=[w], lr=0.02, kind="muon"), dict(params=[e], lr=0.01, kind="adamw")],
                    schedule=dict(max_steps=10, warmup_steps=0, warmdown_ratio=0.5, final_lr_frac=0.0))
    return w, e, opt


def _step(w, e, opt, x):
    opt.zero_grad(set_to_none=True)
    loss = ((x @ e @ w.T) ** 2).mean()
    loss.backward()
    opt.step()
    return loss.item()


def test_training_reduces_loss_and_state_round_trips():
    w, e, opt = _toy()
    x = torch.randn(4, 10, generator=torch.Generator().manual_seed(1))
    losses = [_step(w, e, opt, x) for _ in range(5)]
    assert losses[-1] < losses[0]
    state = copy.deepcopy(opt.state_dict())  # state_dict holds live references, as torch's does
    snapshot = (w.detach().clone(), e.detach().clone())
    after = [_step(w, e, opt, x) for _ in range(3)]

    w2, e2, opt2 = _toy()
    with torch.no_grad():
        w2.copy_(snapshot[0])
        e2.copy_(snapshot[1])
    opt2.load_state_dict(state)
    assert [_step(w2, e2, opt2, x) for _ in range(3)] == after  # bitwise: counter + moments restored


def test_a_resume_keeps_the_configured_hyperparameters_and_names_the_changes(capsys):
    """torch's load_state_dict restores each group's saved lr, betas, ...; a run resumed with
    another optim.matrix_lr would silently keep the old one."""
    w, e, opt = _toy()
    x = torch.randn(4, 10, generator=torch.Generator().manual_seed(1))
    _step(w, e, opt, x)
    state = copy.deepcopy(opt.state_dict())
    _, _, resumed = _toy()
    resumed.param_groups[0]["lr"], resumed.param_groups[1]["betas"] = 0.05, (0.9, 0.99)
    resumed.load_state_dict(state)
    assert [g["lr"] for g in resumed.param_groups] == [0.05, 0.01]
    assert resumed.param_groups[1]["betas"] == (0.9, 0.99)
    assert float(resumed.scalar_state()[0]) == 1.0  # the state itself is the checkpoint's
    assert capsys.readouterr().err.strip() == (
        "xtrain: warning: resuming with changed optimizer settings (the config's apply): "
        "muon group 0 lr 0.02 -> 0.05; adamw group 1 betas (0.8, 0.95) -> (0.9, 0.99)")
    _, _, same = _toy()
    same.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert capsys.readouterr().err == ""  # nothing changed: nothing said


def test_lr_follows_the_device_step_counter():
    w, e, opt = _toy()
    x = torch.randn(4, 10)
    for _ in range(6):
        _step(w, e, opt, x)
    assert float(opt.last_lr_multiplier()) == pytest.approx(float(lr_multiplier(5, 10, 0, 0.5, 0.0)))


def test_unknown_group_kind_is_refused():
    with pytest.raises(ValueError, match="unknown param group kind"):
        MuonAdamW([dict(params=[torch.nn.Parameter(torch.zeros(2, 2))], lr=1.0, kind="sgd")],
                  schedule=dict(max_steps=1, warmup_steps=0, warmdown_ratio=0, final_lr_frac=0))


def _d16_matrix_shapes(compose_config):
    from xtrain.model.config import GPTConfig

    cfg = compose_config(["model=d16"]).model
    cfg.vocab_size, cfg.sequence_len = 65536, 2048
    shapes = GPTConfig.from_model(cfg, "sdpa").param_shapes()
    return sorted({s for n, s in shapes.items() if n.startswith("blocks.")})


def test_batched_newton_schulz_equals_per_matrix_for_every_d16_shape(compose_config):
    shapes = _d16_matrix_shapes(compose_config)
    assert shapes == [(1024, 1024), (1024, 4096), (4096, 1024)]  # q/k/v/proj, mlp proj, mlp fc
    g = torch.Generator().manual_seed(0)
    for shape in shapes:
        stack = torch.randn(3, *shape, generator=g) * torch.tensor([1e-3, 1.0, 50.0])[:, None, None]
        batched = orthogonalize(stack, steps=5)
        one_by_one = torch.stack([orthogonalize(m, steps=5) for m in stack])
        assert (batched - one_by_one).abs().max() <= 1e-5, shape


def _with_spectrum(m, n, smallest, g):
    """A random [m, n] matrix (m <= n) whose singular values fall log-evenly from 1 to
    ``smallest``, in float64."""
    U, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, m, generator=g, dtype=torch.float64))
    return (U * torch.logspace(0, math.log10(smallest), m, dtype=torch.float64)) @ V.mT


def test_the_gram_form_is_as_exact_as_the_iteration_on_x(monkeypatch):
    """Against the exact update (float64), the Gram form's float32 error stays within a small
    factor of the float32 iteration on X's own, for wide and tall matrices, ill-conditioned ones
    included, and more steps than Muon takes."""
    import xtrain.optim as optim

    g = torch.Generator().manual_seed(0)
    wide = {"gaussian": torch.randn(256, 1024, generator=g, dtype=torch.float64),
            "singular values 1 .. 1e-3": _with_spectrum(256, 1024, 1e-3, g),
            "singular values 1 .. 1e-6": _with_spectrum(256, 1024, 1e-6, g),
            "rank 8 + noise": (torch.randn(256, 8, generator=g, dtype=torch.float64)
                               @ torch.randn(8, 1024, generator=g, dtype=torch.float64)
                               + 1e-3 * torch.randn(256, 1024, generator=g, dtype=torch.float64))}
    for name, G in [*wide.items(), ("tall", wide["singular values 1 .. 1e-3"].mT.contiguous())]:
        for steps in (1, 2, 5, 10):
            exact = orthogonalize(G, steps, dtype=torch.float64)  # float64 never takes the Gram form
            gram_error = (orthogonalize(G.float(), steps) - exact).abs().max()
            with monkeypatch.context() as m:
                m.setattr(optim, "GRAM_FORM_ASPECT", math.inf)
                own_error = (orthogonalize(G.float(), steps) - exact).abs().max()
            assert gram_error <= 4 * own_error, (name, steps, float(gram_error), float(own_error))


def test_rectangular_float32_matrices_take_the_gram_form(monkeypatch):
    import xtrain.optim as optim

    calls = []
    gram = optim._newton_schulz_on_gram
    monkeypatch.setattr(optim, "_newton_schulz_on_gram", lambda X, steps: calls.append(X.shape) or gram(X, steps))
    g = torch.Generator().manual_seed(0)
    orthogonalize(torch.randn(64, 16, generator=g), steps=5)  # tall: transposed to [16, 64]
    orthogonalize(torch.randn(16, 32, generator=g), steps=5)  # twice as wide as tall
    assert calls == [(16, 64), (16, 32)]
    orthogonalize(torch.randn(16, 24, generator=g), steps=5)  # 1.5:1, the break-even: on X
    orthogonalize(torch.randn(16, 64, generator=g), steps=5, dtype=torch.bfloat16)  # TPU runs
    assert len(calls) == 2


def _reference_muon_step(params, grads, bufs, lr, momentum=0.95, ns_steps=5):
    """Muon as written before batching: one Newton-Schulz per matrix."""
    for p, g, buf in zip(params, grads, bufs):
        buf.lerp_(g, 1 - momentum)
        update = orthogonalize(g.lerp(buf, momentum), ns_steps)
        p.add_(update * (-lr * max(1.0, p.size(-2) / p.size(-1)) ** 0.5))


def test_the_optimizer_groups_same_shape_matrices_and_gives_the_per_matrix_update():
    from xtrain.optim import same_shape_groups

    g = torch.Generator().manual_seed(1)
    shapes = [(32, 16), (16, 32), (32, 16), (16, 16), (16, 32), (32, 16)]
    params = [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]
    assert same_shape_groups(params) == {(32, 16): [0, 2, 5], (16, 32): [1, 4], (16, 16): [3]}
    reference = [p.detach().clone() for p in params]
    bufs = [torch.zeros_like(p) for p in params]
    opt = MuonAdamW([dict(params=params, lr=0.02, kind="muon")],
                    schedule=dict(max_steps=10, warmup_steps=0, warmdown_ratio=0.0, final_lr_frac=0.0))
    for _ in range(3):
        grads = [torch.randn(*s, generator=g) for s in shapes]
        for p, grad in zip(params, grads):
            p.grad = grad.clone()
        opt.step()
        _reference_muon_step(reference, grads, bufs, lr=0.02)
    for p, ref in zip(params, reference):
        assert (p.detach() - ref).abs().max() <= 1e-6


XLA_NEWTON_SCHULZ = r"""
import json, torch, torch_xla
import torch_xla.experimental.scan as xla_scan
from xtrain.optim import orthogonalize

def unrolled(fn, init, xs, **_):  # what the program held before: a copy of the step per step
    for x in xs:
        init, _ = fn(init, x)
    return init, None

g = torch.Generator().manual_seed(0)
out = {}
for dtype, shape in [("float32", (3, 64, 64)), ("bfloat16", (2, 96, 64))]:
    dt = getattr(torch, dtype)
    G = torch.randn(*shape, generator=g)
    X = {steps: orthogonalize(G.to("xla"), steps, dt) for steps in (2, 5)}
    hlo = {steps: torch_xla._XLAC._get_xla_tensors_hlo([x]) for steps, x in X.items()}
    looped, scan = X[5].cpu().float(), xla_scan.scan
    xla_scan.scan = unrolled
    copies = orthogonalize(G.to("xla"), 5, dt).cpu().float()
    xla_scan.scan = scan
    out[dtype] = {"dots": {s: h.count(" dot(") for s, h in hlo.items()},
                  "whiles": {s: h.count(" while(") for s, h in hlo.items()},
                  "vs_unrolled": float((looped - copies).abs().max()),
                  # against float32's eager iteration on the CPU: how far rounding took each
                  "looped_off": float((looped - orthogonalize(G, 5)).abs().max()),
                  "unrolled_off": float((copies - orthogonalize(G, 5)).abs().max())}
print("RESULT " + json.dumps(out))
"""


def test_newton_schulz_on_xla_is_one_loop_of_the_same_steps():
    """On the XLA engine the steps on X compile as one loop (the TPU compiler's time grows with
    each unrolled copy), with the eager iteration's result: the program's matmuls do not grow with
    the number of steps. XLA:CPU stands in for the TPU's compiled program."""
    r = subprocess.run([sys.executable, "-c", XLA_NEWTON_SCHULZ], cwd=Path(__file__).resolve().parents[1],
                       env={**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    for dtype, found in out.items():
        assert found["whiles"] == {"2": 1, "5": 1}, (dtype, found)
        assert found["dots"]["2"] == found["dots"]["5"] > 0, (dtype, found)
    # float32: the loop computes exactly what the copies did
    assert out["float32"]["vs_unrolled"] <= 1e-6, out
    # bfloat16: the loop rounds its carry at each step, where the copies' fused chains may not;
    # it stays as close to float32's iteration as the copies (measured: 0.052 vs 0.054)
    bf16 = out["bfloat16"]
    assert bf16["looped_off"] <= 1.25 * bf16["unrolled_off"], bf16
    assert out["float32"]["looped_off"] <= 1e-5, out  # and the eager iteration on the CPU
