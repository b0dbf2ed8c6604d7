"""AdamW whose step also applies the gradient-clipping coefficient and refreshes the bf16 compute
copies, in one fused pass (``kernels/adamw.py``) instead of three.

    opt = AdamW(groups, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused_kernel=True)
    opt.set_copies(bf16.masters, bf16.copies)   # precision.BF16Params: copies written by the step
    coef = clip_coefficient(grad_norm, 1.0)     # a device scalar: no host sync
    opt.prepare()                               # optional: the host work now (before a host read)
    opt.step(grad_scale=coef)                   # grads scaled by coef, masters and copies updated

A torch.optim.AdamW: same hyperparameters, the same state (``step``, ``exp_avg``,
``exp_avg_sq``), so checkpoints load either way. With ``fused_kernel`` the update runs the
Triton kernel where Triton runs (a GPU, or the CPU under TRITON_INTERPRET=1), keeping each
parameter's step count on the host (its bias corrections need no device read); otherwise (or
``fused_kernel=False``, ``train.fused_optimizer=false``) it scales the gradients with one
multi-tensor multiply, runs torch's AdamW (fused on CUDA) and copies the masters into the copies:
the unfused path, the same math.

``state_dtype=torch.bfloat16`` (``train.adam_moments_dtype=bf16``) keeps ``exp_avg`` and
``exp_avg_sq`` in bf16, as Megatron's precision-aware optimizer does with ``--exp-avg-dtype bf16
--exp-avg-sq-dtype bf16``: 4 bytes of state per parameter instead of 8, 8 bytes less of traffic
per step; the update is computed in fp32 and the moments rounded to nearest when stored (the
kernel, or its reference on a CPU without Triton; torch's AdamW cannot). A checkpoint's moments
are cast to the run's dtype on load, so runs move between the two.

``build_optimizer`` makes one with Megatron's parameter groups (no weight decay on biases and
norm weights); ``lr_at`` is the learning-rate schedule (linear warm-up, cosine decay).
"""
from __future__ import annotations

import math

import torch

from megatron_moe.kernels._common import use_triton
from megatron_moe.kernels.adamw import BlockMap, adamw_prepare, hyperparameters


class AdamW(torch.optim.AdamW):
    def __init__(self, params, *, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float = 0.0, fused_kernel: bool = True,
                 state_dtype: torch.dtype = torch.float32):
        params = list(params)
        first = params[0]["params"][0] if isinstance(params[0], dict) else params[0]
        if state_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"megatron_moe.training.optimizer.AdamW: state_dtype={state_dtype}: expected "
                             "torch.float32 or torch.bfloat16")
        if state_dtype != torch.float32 and not fused_kernel:
            raise ValueError("megatron_moe.training.optimizer.AdamW: bf16 moments need fused_kernel=True "
                             "(torch's AdamW keeps its moments in the parameters' dtype)")
        self.state_dtype = state_dtype
        # our update: the kernel where Triton runs; with bf16 moments also elsewhere (its reference)
        self.fused_kernel = bool(fused_kernel) and (use_triton(first) or state_dtype != torch.float32)
        # the unfused path: torch's fused multi-tensor kernel on CUDA, its default elsewhere
        torch_fused = True if (first.is_cuda and not self.fused_kernel) else None
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=torch_fused)
        self._torch_fused = torch_fused
        self._copy_of: dict[int, torch.Tensor] = {}
        self._block_map: BlockMap | None = None
        self._host_step: dict[int, int] = {}  # id(p) -> its state["step"], read once from there
        self._prepared: tuple | None = None  # prepare()'s plan for the next step()

    def set_copies(self, masters: list[torch.Tensor], copies: list[torch.Tensor]) -> None:
        """After each step, copies[i] holds masters[i] rounded to its dtype (precision.BF16Params)."""
        if len(masters) != len(copies):
            raise ValueError(f"AdamW.set_copies: {len(masters)} masters but {len(copies)} copies")
        self._copy_of = {id(m): c for m, c in zip(masters, copies)}
        self._prepared = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's, except that zeroing in place (``set_to_none=False``: a CUDA graph adds into the
        gradients it was captured with) is one multi-tensor call per device and dtype, not one
        launch per parameter: between the optimizer and the next replay the GPU has nothing else
        to run, so each launch is time it waits for the host."""
        if set_to_none:
            return super().zero_grad(set_to_none=True)
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        with torch.autograd.profiler.record_function(f"Optimizer.zero_grad#{type(self).__name__}.zero_grad"):
            for group in self.param_groups:
                for p in group["params"]:
                    g = p.grad
                    if g is None:
                        continue
                    if g.grad_fn is not None:
                        g.detach_()
                    else:
                        g.requires_grad_(False)
                    by_kind.setdefault((g.device, g.dtype), []).append(g)
            for grads in by_kind.values():
                torch._foreach_zero_(grads)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # casts the moments to the parameters' dtype (fp32)
        self._host_step.clear()
        self._prepared = None
        # the saved groups' flags replace ours on load: keep this instance's path, and each
        # step count where that path reads it (host for the kernel, the device for torch's fused)
        for group in self.param_groups:
            group["fused"] = self._torch_fused
            group["foreach"] = None
            for p in group["params"]:
                st = self.state.get(p)
                if st and torch.is_tensor(st.get("step")):
                    on = p.device if self._torch_fused else torch.device("cpu")
                    st["step"] = st["step"].detach().to(torch.float32).to(on)
                for k in ("exp_avg", "exp_avg_sq"):
                    if st and torch.is_tensor(st.get(k)) and st[k].dtype != self.state_dtype:
                        st[k] = st[k].to(self.state_dtype)

    def prepare(self) -> None:
        """step()'s host work ahead of it: the checks, the address table and the step's
        hyperparameters on the device. A step() that follows with the same hyperparameters and
        the same memory for every parameter, gradient, moment and copy only launches the kernel;
        otherwise it builds anew. The training step calls this before its one host read, while
        the GPU still runs the micro-batches, so that after the read the GPU waits for one launch
        and not for this Python. Nothing is updated until step() (a parameter's zero moments are
        created at its first preparation; a step that is skipped leaves the counts as they were)."""
        self._prepared = self._plan() if self.fused_kernel else None

    def _plan_key(self) -> tuple:
        """What a prepared step depends on: each group's hyperparameters, and where each
        parameter, its gradient, moments and copy live (the address table holds that memory)."""
        def where(t):
            return None if t is None else t.data_ptr()

        def tensors(p):
            st = self.state.get(p) or {}
            return (p.data_ptr(), where(p.grad), where(st.get("exp_avg")), where(st.get("exp_avg_sq")),
                    where(self._copy_of.get(id(p))))

        return tuple((g["lr"], g["weight_decay"], g["betas"], g["eps"], tuple(tensors(p) for p in g["params"]))
                     for g in self.param_groups)

    def _plan(self) -> tuple:
        """(key, [the update's launch per device], the step tensors and their new counts)."""
        if self._copy_of:  # checked before anything changes
            with_grad = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            missing = sum(id(p) not in self._copy_of for p in with_grad)
            if missing:
                raise ValueError(f"megatron_moe.training.optimizer.AdamW: {missing} of {len(with_grad)} parameters "
                                 "have no compute copy: set_copies must cover every parameter (or none)")
        params, grads, exp_avgs, exp_avg_sqs, hyper, steps, counts = [], [], [], [], [], [], []
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"]:
                raise ValueError("megatron_moe.training.optimizer.AdamW: amsgrad and maximize are not supported")
            beta1, beta2 = group["betas"]
            by_step: dict[int, tuple[float, ...]] = {}  # the group's parameters share their scalars
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0, dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.contiguous_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype,
                                                        memory_format=torch.contiguous_format)
                # the count lives in state["step"] (checkpoints, torch's AdamW); a host mirror
                # spares a device-to-host read and a tensor op per parameter per step
                t = self._host_step.get(id(p))
                t = (int(st["step"].item()) if t is None else t) + 1
                counts.append(t)
                steps.append(st["step"])
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(st["exp_avg"])
                exp_avg_sqs.append(st["exp_avg_sq"])
                if t not in by_step:
                    by_step[t] = hyperparameters(float(group["lr"]), group["weight_decay"], beta1,
                                                 beta2, group["eps"], t)
                hyper.append(by_step[t])
        copies = [self._copy_of[id(p)] for p in params] if self._copy_of else None
        # the one launch per device (a model's parameters share one); adamw_prepare checks the
        # tensors before anything changes, so the step counts advance only after the launch
        launches = []
        for dev in {p.device for p in params}:
            idx = [k for k, p in enumerate(params) if p.device == dev]
            pick = lambda xs: [xs[k] for k in idx]  # noqa: E731
            launch = adamw_prepare(pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs), pick(hyper),
                                   copies=pick(copies) if copies is not None else None, block_map=self._block_map)
            self._block_map = launch.block_map
            launches.append((dev, launch))
        # the key last: a parameter's first plan has just created its moments
        return self._plan_key(), launches, steps, [id(p) for p in params], counts

    @torch.no_grad()
    def step(self, closure=None, grad_scale: torch.Tensor | None = None):
        """One update of every parameter that has a gradient; ``grad_scale`` (a scalar tensor on
        the parameters' device, e.g. the clipping coefficient) multiplies the gradients first.
        Uses what prepare() made ready when nothing it depends on has changed since."""
        if closure is not None:
            raise ValueError("megatron_moe.training.optimizer.AdamW.step: closures are not supported")
        if not self.fused_kernel:
            self._unfused_step(grad_scale)
            return None
        plan, self._prepared = self._prepared, None
        if plan is None or plan[0] != self._plan_key():
            plan = self._plan()
        _, launches, steps, ids, counts = plan
        for dev, launch in launches:
            launch.run(grad_scale.to(dev) if grad_scale is not None else None)
        if steps:
            torch._foreach_add_(steps, 1.0)
            self._host_step.update(zip(ids, counts))
        return None

    def _unfused_step(self, grad_scale):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if grad_scale is not None and grads:
            torch._foreach_mul_(grads, grad_scale.to(grads[0].dtype))
        super().step()
        if self._copy_of:
            masters = [p for g in self.param_groups for p in g["params"] if id(p) in self._copy_of]
            torch._foreach_copy_([self._copy_of[id(p)] for p in masters], masters)


def trainable_params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """named_parameters without duplicates (tied embeddings count once), trainable only."""
    seen, out = set(), []
    for name, p in model.named_parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        out.append((name, p))
    return out


def build_optimizer(model: torch.nn.Module, tc) -> AdamW:
    """AdamW with Megatron's decay rule: no weight decay on biases and 1-D (norm) weights;
    ``tc.fused_optimizer``: clipping scale, update and bf16 copies in one kernel pass;
    ``tc.adam_moments_dtype``: the moments' dtype."""
    decay, no_decay = [], []
    for name, p in trainable_params(model):
        (no_decay if (name.endswith(".bias") or p.ndim == 1) else decay).append(p)
    groups = [{"params": decay, "weight_decay": tc.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    return AdamW(groups, lr=tc.lr, betas=(tc.adam_beta1, tc.adam_beta2), eps=tc.adam_eps,
                 fused_kernel=tc.fused_optimizer,
                 state_dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[tc.adam_moments_dtype])


def lr_at(step: int, tc) -> float:
    """Learning rate of step ``step`` (0-based): linear warm-up from lr/warmup to lr over
    lr_warmup_iters steps, then cosine decay to min_lr at lr_decay_iters, then min_lr."""
    warm, decay = tc.lr_warmup_iters, tc.decay_iters
    if step < warm:
        return tc.lr * (step + 1) / warm
    if step >= decay:
        return tc.min_lr
    progress = (step - warm) / max(decay - warm, 1)
    return tc.min_lr + 0.5 * (tc.lr - tc.min_lr) * (1.0 + math.cos(math.pi * progress))
