"""Muon + AdamW in one optimizer, and the learning-rate schedule as a tensor function.

Why one hand-written optimizer rather than ``torch.optim.Muon`` + ``torch.optim.AdamW``: the XLA
engine compiles the *whole* optimizer step (all micro-batches, clipping, both updates) as one
graph, which needs a single ``optimizer.step(closure)``; and every scheduled scalar (the LR
multiplier, Adam's bias corrections) must be a device tensor computed from a device-side step
counter, so the graph is identical at every step and nothing is read back to the host. Each
update is a few lines (nanochat's), so owning them is cheaper than adapting two optimizers.
"""

from __future__ import annotations

import torch

from xtrain.errors import warn


def lr_multiplier(step, max_steps: int, warmup_steps: int, warmdown_ratio: float, final_lr_frac: float):
    """Warmup -> constant -> linear warmdown to ``final_lr_frac``, for 0-based ``step``.

    Works on tensors (device-side, graph-stable) and on Python numbers (logging, tests).
    """
    step = torch.as_tensor(step, dtype=torch.float32)
    warmdown = max(1, round(warmdown_ratio * max_steps)) if warmdown_ratio > 0 else 0
    up = torch.clamp((step + 1) / warmup_steps, max=1.0) if warmup_steps > 0 else torch.ones_like(step)
    if warmdown:
        frac = torch.clamp((max_steps - step) / warmdown, min=0.0, max=1.0)
        down = frac + (1 - frac) * final_lr_frac
    else:
        down = torch.ones_like(step)
    return torch.minimum(up, down)


NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # quintic, Keller Jordan's Muon
# float32 matrices whose long side is at least this many times the short one run the
# Newton-Schulz steps on their Gram matrix (:func:`_newton_schulz_on_gram`; it pays from 1.5)
GRAM_FORM_ASPECT = 2
GRAM_FORM_RESTART = 3  # steps between two restarts of the Gram form from X


def takes_gram_form(shape, dtype=torch.float32) -> bool:
    """Whether :func:`orthogonalize` runs a matrix of ``shape`` [..., m, n] in the Gram form."""
    return dtype == torch.float32 and max(shape[-2:]) >= GRAM_FORM_ASPECT * min(shape[-2:])


@torch.no_grad()
def orthogonalize(G: torch.Tensor, steps: int, dtype=torch.float32) -> torch.Tensor:
    """Newton-Schulz iteration towards the nearest semi-orthogonal matrix (Keller Jordan's Muon);
    bfloat16 is enough on TPUs. ``G`` is one matrix [m, n] or a stack [k, m, n] of same-shape
    matrices, each orthogonalised on its own."""
    X = G.to(dtype)
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    if takes_gram_form(X.shape, dtype):
        X = _newton_schulz_on_gram(X, steps)
    elif X.device.type == "xla":
        # one loop in the compiled program instead of `steps` unrolled copies: the TPU compiler's
        # time grows with each copy (d16 on v6e4, scanned, one micro-batch, one machine: 87.5 s
        # with the copies, 74.6 s looped; README.md, "Compiling once")
        from torch_xla.experimental.scan import scan

        X, _ = scan(_newton_schulz_step, X, torch.zeros(steps, device=X.device), is_fn_pure=True)
    else:
        for _ in range(steps):
            X, _ = _newton_schulz_step(X)
    if tall:
        X = X.mT
    return X.to(G.dtype)


def _newton_schulz_step(X: torch.Tensor, _=None):
    """One Newton-Schulz step on X [..., m, n] (m <= n); in the shape of a scan's body, (carry,
    scanned input) -> (carry, output), defined once so the scan's trace is cached."""
    a, b, c = NS_COEFFICIENTS
    A = X @ X.mT
    return a * X + (b * A + c * A @ A) @ X, None


def _newton_schulz_on_gram(X: torch.Tensor, steps: int) -> torch.Tensor:
    """The same steps for a wide X [m, n] (m < n), on [m, m] matrices. Each step multiplies X on
    the left by a polynomial in X X^T, so after k steps X_k = Q_k X with Q_k [m, m], and
    X_k X_k^T = Q_k S Q_k^T with S = X X^T: the steps update Q, and X is multiplied at the end.
    Q's norm grows like a^k (until near 1 / X's smallest singular value) and amplifies S's
    rounding, so the form restarts from X every GRAM_FORM_RESTART steps, which keeps it below
    a^3 ~ 41: on the test's inputs (tests/test_optim.py; singular values down to 1e-6, up to 10
    steps) float32 then stays within 3x of the iteration on X's own error against float64, 1.4x
    at 5 steps; without restarts, 8x at 5 steps and unbounded at 10. A run of r steps
    costs 4 m^2 n + (8 r - 6) m^3 FLOPs instead of r (4 m^2 n + 2 m^3): 0.67x at n = 4m (the
    MLP's matrices) and 5 steps. bfloat16 keeps the steps on X: this form was checked in float32
    only."""
    a, b, c = NS_COEFFICIENTS
    eye = torch.eye(X.size(-2), dtype=X.dtype, device=X.device)
    for done in range(0, steps, GRAM_FORM_RESTART):
        S = X @ X.mT
        Q = a * eye + b * S + c * S @ S  # the first step, where Q = I and A = S
        for _ in range(min(GRAM_FORM_RESTART, steps - done) - 1):
            A = Q @ S @ Q.mT
            Q = a * Q + (b * A + c * A @ A) @ Q
        X = Q @ X
    return X


def same_shape_groups(params) -> dict[tuple, list[int]]:
    """shape -> indices of the parameters with that shape, in order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault(tuple(p.shape), []).append(i)
    return groups


class MuonAdamW(torch.optim.Optimizer):
    """Param groups carry ``kind``: "muon" (2-D matrices) or "adamw". ``lr`` is each group's peak
    rate; the schedule multiplies it by :func:`lr_multiplier` of the device-side step counter."""

    def __init__(self, groups, schedule: dict, betas=(0.8, 0.95), eps=1e-10, momentum=0.95,
                 ns_steps=5, weight_decay=0.0, ns_dtype=torch.float32):
        defaults = dict(betas=betas, eps=eps, momentum=momentum, ns_steps=ns_steps,
                        weight_decay=weight_decay)
        self.ns_dtype = ns_dtype
        super().__init__(groups, defaults)
        self.schedule = dict(schedule)
        for group in self.param_groups:
            if group["kind"] not in ("muon", "adamw"):
                raise ValueError(f"unknown param group kind {group['kind']!r}")

    def _step_counter(self, device):
        if getattr(self, "_t", None) is None:
            self._t = torch.zeros((), dtype=torch.float32, device=device)
        return self._t

    def state_dict(self):
        sd = super().state_dict()
        sd["step_counter"] = getattr(self, "_t", None)
        return sd

    def load_state_dict(self, state_dict):
        """The saved state and step counter; the hyperparameters stay the configured ones (torch
        would restore each group's saved lr, betas, ...: a resumed run with a changed
        ``optim.*`` would silently train with the old values). Changes are named in a warning."""
        state_dict = dict(state_dict)
        counter = state_dict.pop("step_counter", None)
        configured = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        saved = [{k: v for k, v in g.items() if k != "params"} for g in state_dict["param_groups"]]
        super().load_state_dict(state_dict)
        for group, mine in zip(self.param_groups, configured):
            group.update(mine)
        changed = [f"{mine['kind']} group {i} {k} {theirs.get(k)} -> {v}"
                   for i, (mine, theirs) in enumerate(zip(configured, saved))
                   for k, v in mine.items() if theirs.get(k) != v]
        if changed:
            warn("resuming with changed optimizer settings (the config's apply): " + "; ".join(changed))
        device = self.param_groups[0]["params"][0].device
        self._t = None if counter is None else counter.detach().clone().to(device)

    def last_lr_multiplier(self) -> torch.Tensor:
        """The multiplier the last step used: a device tensor the step computed (read it only
        when logging)."""
        mult = getattr(self, "_last_mult", None)
        return lr_multiplier(0, **self.schedule) if mult is None else mult

    @torch.no_grad()
    def init_state(self, make=None) -> None:
        """Create every missing state buffer now instead of inside the first step, so the first
        step traces the same graph as all later ones (one compilation under XLA). Restored state
        is kept. ``make(zeros)`` may replace each new zero buffer (the TPU preflight swaps in
        buffer-less placeholders)."""
        make = make or (lambda zeros: zeros)
        device = self.param_groups[0]["params"][0].device
        if getattr(self, "_t", None) is None:
            self._t = make(self._step_counter(device))
        for group in self.param_groups:
            for p in group["params"]:
                if not self.state[p]:
                    state = self._state_for(p, group["kind"])
                    for name, buf in state.items():
                        state[name] = make(buf)

    def scalar_state(self) -> list[torch.Tensor]:
        """State that belongs to no parameter (the step counter)."""
        return [self._t] if getattr(self, "_t", None) is not None else []

    def _state_for(self, p, kind: str) -> dict:
        state = self.state[p]
        if not state:
            names = ("momentum_buffer",) if kind == "muon" else ("exp_avg", "exp_avg_sq")
            for name in names:
                state[name] = torch.zeros_like(p)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._last_mult = self.update()
        return loss

    def compile_update(self, compile_fn) -> None:
        """Run the update (everything after the gradients) through ``compile_fn``, e.g.
        ``torch.compile`` (the CPU engine); the state must exist first (:meth:`init_state`), or
        the first call would trace a different graph from every later one."""
        self.init_state()
        self.update = compile_fn(self.apply_update)

    def update(self) -> torch.Tensor:
        return self.apply_update()

    @torch.no_grad()
    def apply_update(self) -> torch.Tensor:
        """Both updates at the scheduled rates; returns the LR multiplier used."""
        device = self.param_groups[0]["params"][0].device
        t = self._step_counter(device)
        mult = lr_multiplier(t, **self.schedule).to(device)
        t.add_(1)
        for group in self.param_groups:
            lr = group["lr"] * mult
            if group["kind"] == "muon":
                self._muon(group, lr)
            else:
                self._adamw(group, lr, t)
        return mult

    def _muon(self, group, lr):
        params = [p for p in group["params"] if p.grad is not None]
        momentum = group["momentum"]
        updates = []
        for p in params:
            buf = self._state_for(p, "muon")["momentum_buffer"]
            buf.lerp_(p.grad, 1 - momentum)
            updates.append(p.grad.lerp(buf, momentum))  # Nesterov
        for shape, members in same_shape_groups(params).items():
            # one batched Newton-Schulz per shape (nanochat's optimizer does the same): a d16
            # step has 4 shapes, not 96 matrices, so 4 copies of the iteration in a traced graph
            stacked = orthogonalize(torch.stack([updates[i] for i in members]),
                                    group["ns_steps"], self.ns_dtype)
            # Orthogonal updates have unit spectral norm; scale so tall matrices (rows > cols)
            # get the same per-element RMS as square ones.
            step = -lr * max(1.0, shape[-2] / shape[-1]) ** 0.5
            for i, update in zip(members, stacked.unbind(0)):
                p = params[i]
                if group["weight_decay"]:
                    p.mul_(1 - lr * group["weight_decay"])
                p.add_(update * step)

    def _adamw(self, group, lr, t):
        beta1, beta2 = group["betas"]
        bias1 = 1 - beta1 ** t
        bias2 = 1 - beta2 ** t
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self._state_for(p, "adamw")
            m, v = state["exp_avg"], state["exp_avg_sq"]
            m.lerp_(p.grad, 1 - beta1)
            v.lerp_(p.grad.square(), 1 - beta2)
            if group["weight_decay"]:
                p.mul_(1 - lr * group["weight_decay"])
            denom = (v / bias2).sqrt() + group["eps"]
            p.add_((m / bias1) / denom * (-lr))


def build_optimizer(model, optim, max_steps: int, precision: str = "float32") -> MuonAdamW:
    """Groups and learning rates from the ``optim`` config group (see OptimConfig)."""
    matrices, embedding, head = model.param_groups()
    width = model.config.n_embd
    adam_scale = (width / 768) ** -0.5 if optim.scale_adam_lr_by_width else 1.0
    groups = [
        dict(params=matrices, lr=optim.matrix_lr, kind="muon"),
        dict(params=embedding, lr=optim.embedding_lr * adam_scale, kind="adamw", weight_decay=0.0),
        dict(params=head, lr=optim.unembedding_lr * adam_scale, kind="adamw", weight_decay=0.0),
    ]
    schedule = dict(max_steps=max_steps, warmup_steps=optim.warmup_steps,
                    warmdown_ratio=optim.warmdown_ratio, final_lr_frac=optim.final_lr_frac)
    return MuonAdamW(groups, schedule, betas=(optim.adam_beta1, optim.adam_beta2), eps=optim.adam_eps,
                     momentum=optim.muon_momentum, ns_steps=optim.muon_ns_steps,
                     weight_decay=optim.weight_decay,
                     ns_dtype=torch.bfloat16 if precision == "bfloat16" else torch.float32)
