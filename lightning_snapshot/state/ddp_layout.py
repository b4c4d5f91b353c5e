"""Keep DDP's gradient bucket layout across a restart, so that 3+ rank DDP resumes bitwise.

Used by the snapshot pipeline (pipeline.py: :func:`capture_layout`, stored with each snapshot's late state) and by
the Restorer (restore.py: :func:`apply_layout` when a snapshot is restored).

Why: ``DistributedDataParallel`` (with ``find_unused_parameters=False``, Lightning's default, or with
``static_graph=True``) puts every gradient into one bucket, in parameter order, for a process's first backward, and
before its second forward rebuilds the buckets once, in the order the gradients became ready. A restarted process
starts over with the initial layout, so the first step after a restart all-reduces the same gradients laid out
differently. Ring all-reduce (gloo, NCCL) adds the ranks' values of an element in an order that depends on the
element's position in the flat bucket; with 3 or more ranks floating-point addition is then not associative enough
to give the same bits (with 2 ranks ``a + b == b + a`` and it does not matter).

What: :func:`capture_layout` reads the live (rebuilt) layout as plain JSON-able data; :func:`apply_layout`, called in
the restarted process after the model is wrapped and before its first forward, rebuilds the reducer with that layout
so that the first step after the restart all-reduces exactly as the uninterrupted process did. The new reducer still
rebuilds once after its first backward (nothing public or private lets Python mark a reducer "already rebuilt"); the
rebuild recomputes the layout from the gradient-ready order and the same bucket caps, so it lands on the same layout
whenever the model's gradient-ready order is the same on every step (a static autograd graph: DDP's own rebuild-once
design assumes the same).

No public API exposes or sets the layout. This module relies on these private torch internals, all present in
torch 2.2/2.3's ``torch/nn/parallel/distributed.py`` (read in the PyTorch sources; this project supports torch >= 2.3)
and in 2.13 (installed and tested); the C++ side (``Reducer::rebuild_buckets`` recomputing the layout from the
gradient-ready order with ``[first_bucket_bytes_cap, bucket_bytes_cap]``, ``has_rebuilt_bucket_`` set only there) is
the same in both:

* ``DistributedDataParallel._has_rebuilt_buckets`` (set by ``forward`` when ``reducer._rebuild_buckets()`` returns
  True), ``reducer._rebuild_buckets()``, ``reducer._get_zeros_like_grad_buckets()`` (used by DDP's ``join``) and
  ``GradBucket.parameters()`` (public: the comm-hook API), to read the live layout;
* ``DistributedDataParallel._build_params_for_reducer()``, ``_build_debug_param_to_name_mapping()`` and
  ``_ddp_init_helper(parameters, expect_sparse_gradient, param_to_name_mapping, static_graph)`` -- the very sequence
  DDP's own ``__setstate__`` runs to build a reducer -- with ``torch.distributed._compute_bucket_assignment_by_size``
  (looked up on the module at call time by ``_ddp_init_helper``) replaced for the duration of that call so that it
  returns the saved layout; then ``reducer._set_static_graph()`` / ``logger._set_static_graph()`` as ``__setstate__``
  does, and Python comm hooks re-registered from ``_comm_hooks`` (where the torch keeps them) with
  ``torch.distributed._register_comm_hook``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["DDP_LAYOUT_ENV", "LAYOUT_VERSION", "apply_layout", "capture_layout", "check_layout", "enabled", "is_ddp"]

#: Set to 0 (or off/false/no) to neither store nor give back DDP's gradient-bucket layout.
DDP_LAYOUT_ENV = "LIGHTNING_SNAPSHOT_DDP_LAYOUT"


def enabled() -> bool:
    """Whether snapshots store DDP's layout and restores give it back (``DDP_LAYOUT_ENV`` not turned off)."""
    return os.environ.get(DDP_LAYOUT_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


LAYOUT_VERSION = 1
_APPLIED = "_lightning_snapshot_applied_layout"
_CAPTURED = "_lightning_snapshot_captured_layout"  # the layout read once the reducer has rebuilt (plain data)


def _ddp_class():
    if not torch.distributed.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


def is_ddp(module: Any) -> bool:
    """Whether ``module`` is a ``torch.nn.parallel.DistributedDataParallel``."""
    cls = _ddp_class()
    return cls is not None and isinstance(module, cls)


def _signature(params: list[torch.Tensor]) -> tuple[list[int], list[str]]:
    return [int(p.numel()) for p in params], [str(p.dtype).removeprefix("torch.") for p in params]


def capture_layout(ddp_module: Any, *, rebuild_pending: bool = False) -> dict | None:
    """The gradient bucket layout ``ddp_module`` all-reduces with now, as plain data, or None.

    Returns ``{"version": 1, "buckets": [[param index, ...], ...], "numels": [...], "dtypes": [...]}``: the buckets in
    reduction order, each listing the indices (into DDP's reducer parameter order: ``module.named_parameters()``
    order, requiring grad, not ignored, deduplicated) of the parameters in the order they sit in the flat bucket.

    None when ``ddp_module`` is not a ``DistributedDataParallel``, or its buckets have not been rebuilt yet (then
    the restarted process's initial layout is the right one: before the first synchronized backward, or with
    ``find_unused_parameters=True`` without ``static_graph``, where DDP never rebuilds). Right after the first
    synchronized backward the rebuild is still pending (DDP does it at the start of the next forward); with
    ``rebuild_pending=True`` that rebuild is done here instead, exactly as the next forward would do it -- a
    collective (a broadcast from rank 0), so every rank must call this at the same point; with False (the default)
    no collective is issued and None is returned in that state.

    Reads ``reducer._get_zeros_like_grad_buckets()``, which allocates zeros the size of the gradients for the
    duration of the call, once per reducer: DDP rebuilds only once, so the layout read is kept on the module and
    returned by later calls. A layout given to :func:`apply_layout` in this process is returned as is until the
    reducer has rebuilt again (no allocation).
    """
    if not is_ddp(ddp_module):
        return None
    reducer = getattr(ddp_module, "reducer", None)
    if reducer is None:  # every parameter is all-reduced by DDP's delayed hook, no reducer buckets
        return None
    if not getattr(ddp_module, "_has_rebuilt_buckets", False):
        applied = ddp_module.__dict__.get(_APPLIED)
        if applied is not None:
            return {**applied, "buckets": [list(b) for b in applied["buckets"]]}
        if not rebuild_pending or not reducer._rebuild_buckets():
            return None
        ddp_module._has_rebuilt_buckets = True
    layout = ddp_module.__dict__.get(_CAPTURED)  # (apply_layout, which replaces the reducer, drops it)
    if layout is None:
        params = ddp_module._build_params_for_reducer()[0]
        index = {id(p): i for i, p in enumerate(params)}
        buckets = [[index[id(p)] for p in bucket.parameters()] for bucket in reducer._get_zeros_like_grad_buckets()]
        numels, dtypes = _signature(params)
        layout = {"version": LAYOUT_VERSION, "buckets": buckets, "numels": numels, "dtypes": dtypes}
        ddp_module.__dict__[_CAPTURED] = layout
    return {**layout, "buckets": [list(b) for b in layout["buckets"]]}


def _check(layout: Any, params: list[torch.Tensor]) -> list[list[int]]:
    if not isinstance(layout, dict) or layout.get("version") != LAYOUT_VERSION:
        raise ValueError(f"not a DDP bucket layout of version {LAYOUT_VERSION}: {layout!r:.200}")
    buckets, numels, dtypes = layout.get("buckets"), layout.get("numels"), layout.get("dtypes")
    if (
        not isinstance(buckets, list)
        or not buckets
        or not all(isinstance(b, list) and b for b in buckets)
        or not all(isinstance(i, int) and not isinstance(i, bool) for b in buckets for i in b)
    ):
        raise ValueError(f"malformed DDP bucket layout: buckets={buckets!r:.200}")
    live_numels, live_dtypes = _signature(params)
    if not isinstance(numels, list) or len(numels) != len(params):
        raise ValueError(
            f"the DDP bucket layout was taken for a model with "
            f"{len(numels) if isinstance(numels, list) else '?'} parameters requiring grad; this model "
            f"has {len(params)}"
        )
    if numels != live_numels:
        bad = next(i for i, (a, b) in enumerate(zip(numels, live_numels, strict=True)) if a != b)
        raise ValueError(
            f"the DDP bucket layout does not fit this model: parameter {bad} has {live_numels[bad]} "
            f"elements here, {numels[bad]} in the layout"
        )
    if dtypes is not None and (not isinstance(dtypes, list) or len(dtypes) != len(params)):
        raise ValueError(f"malformed DDP bucket layout: dtypes={dtypes!r:.200} does not name one dtype per parameter")
    if dtypes is not None and dtypes != live_dtypes:
        bad = next(i for i, (a, b) in enumerate(zip(dtypes, live_dtypes, strict=True)) if a != b)
        raise ValueError(
            f"the DDP bucket layout does not fit this model: parameter {bad} is {live_dtypes[bad]} "
            f"here, {dtypes[bad]} in the layout"
        )
    flat = sorted(i for b in buckets for i in b)
    if flat != list(range(len(params))):
        raise ValueError(
            f"malformed DDP bucket layout: its buckets must hold every parameter index 0.."
            f"{len(params) - 1} exactly once, got {buckets!r:.200}"
        )
    for b in buckets:  # a flat bucket holds one dtype (and device) only
        if len({live_dtypes[i] for i in b}) > 1 or len({params[i].device for i in b}) > 1:
            raise ValueError(f"the DDP bucket layout does not fit this model: bucket {b} mixes dtypes or devices")
    return [list(b) for b in buckets]


def _prepare(ddp: Any, layout: Any) -> tuple[list[torch.Tensor], Any, list[list[int]], list[Any]]:
    """Everything :func:`apply_layout` checks, without changing ``ddp``: (parameters, expect_sparse_gradient,
    buckets, comm hooks to carry over). Raises ``ValueError`` naming the problem."""
    if getattr(ddp, "mixed_precision", None) is not None:
        raise ValueError("apply_layout does not support DDP's mixed_precision")
    if getattr(ddp, "_use_python_reducer", False) or getattr(ddp, "_delay_all_reduce_all_params", False):
        raise ValueError(
            "apply_layout needs DDP's C++ reducer (not the compiled/Python reducer, not every parameter delayed)"
        )
    if getattr(ddp, "_lazy_init_ran", False) or getattr(ddp, "_has_rebuilt_buckets", False):
        raise ValueError("apply_layout must be called before the DDP module's first forward")
    parameters, expect_sparse_gradient = ddp._build_params_for_reducer()
    buckets = _check(layout, parameters)
    comm_hooks = list(getattr(ddp, "_comm_hooks", []))  # (hook, state), kept by register_comm_hook (newer torch)
    hook_name = ddp._get_ddp_logging_data().get("comm_hook") if ddp.logger is not None else None
    if hook_name and not comm_hooks:
        raise ValueError(
            f"apply_layout cannot carry the comm hook {hook_name!r} over to the new reducer (a built-in "
            "hook, or a torch that does not keep registered hooks in "
            "DistributedDataParallel._comm_hooks)"
        )
    return parameters, expect_sparse_gradient, buckets, comm_hooks


def check_layout(ddp_module: Any, layout: Any) -> None:
    """Raise ``ValueError`` (naming why) when :func:`apply_layout` would refuse ``layout`` for ``ddp_module``.

    Changes nothing and issues no collective; a no-op when ``layout`` is None or ``ddp_module`` is not a
    ``DistributedDataParallel``. ``layout`` is treated as untrusted input (any JSON value).
    """
    if layout is not None and is_ddp(ddp_module):
        _prepare(ddp_module, layout)


def apply_layout(ddp_module: Any, layout: dict | None) -> None:
    """Give ``ddp_module`` (a ``DistributedDataParallel``) the bucket layout ``layout`` from :func:`capture_layout`.

    Call it in the restarted process after the model was wrapped (in Lightning: ``trainer.strategy.model`` by
    ``on_fit_start``) and before the first forward, on every rank with the same layout (no collective is issued).
    A no-op when ``layout`` is None or ``ddp_module`` is not a ``DistributedDataParallel`` (one process has no
    all-reduce). Raises ``ValueError``, before changing anything, when the layout does not fit the model (another
    number of parameters, other sizes or dtypes, not every index exactly once), when the module already ran a
    forward, or for DDP set-ups this does not handle (``mixed_precision``, the compiled/Python reducer, every
    parameter delayed); :func:`check_layout` runs the same checks alone.

    It replaces ``ddp_module.reducer`` (and ``ddp_module.logger``) by a reducer built by DDP's own
    ``_ddp_init_helper`` with the saved bucket indices; the old reducer frees and removes its autograd hooks. Comm
    hooks registered with ``register_comm_hook`` are registered again on the new reducer (from
    ``DistributedDataParallel._comm_hooks``); when a comm hook is registered that cannot be (a built-in C++ hook, or a
    torch without ``_comm_hooks``; seen in ``_get_ddp_logging_data()["comm_hook"]``), ``ValueError`` is raised.
    """
    if layout is None or not is_ddp(ddp_module):
        return
    ddp = ddp_module
    parameters, expect_sparse_gradient, buckets, comm_hooks = _prepare(ddp, layout)
    param_to_name_mapping = ddp._build_debug_param_to_name_mapping(parameters)

    dist = torch.distributed
    original = dist._compute_bucket_assignment_by_size
    caps = [int(ddp.bucket_bytes_cap)] * len(buckets)  # only logged by the reducer's constructor

    def saved_assignment(*_args: Any, **_kwargs: Any):
        # _ddp_init_helper hands the reducer list(reversed(...)) of what this returns
        return [list(b) for b in reversed(buckets)], list(caps)

    dist._compute_bucket_assignment_by_size = saved_assignment
    try:
        ddp._ddp_init_helper(parameters, expect_sparse_gradient, param_to_name_mapping, ddp.static_graph)
    finally:
        dist._compute_bucket_assignment_by_size = original
    if ddp.static_graph:
        ddp.reducer._set_static_graph()
        ddp.logger._set_static_graph()
    for hook, state in comm_hooks:
        ddp.logger._set_comm_hook_name(hook.__qualname__)
        dist._register_comm_hook(ddp.reducer, state, hook)
    ddp._has_rebuilt_buckets = False
    ddp.__dict__.pop(_CAPTURED, None)
    numels, dtypes = _signature(parameters)
    ddp.__dict__[_APPLIED] = {"version": LAYOUT_VERSION, "buckets": buckets, "numels": numels, "dtypes": dtypes}
