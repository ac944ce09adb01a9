"""Capture a user's model (and loss) as an FX graph with torch.export (non-strict).

`capture` is the compiler's entry, nn.Module -> GraphModule; the passes that follow are
GraphModule -> GraphModule (passes/manager.py).

Requires: an nn.Module on real or meta tensors, example inputs on the same device, optionally
  loss_fn(model_output, targets) and targets (the output is passed to loss_fn as is, so a
  transformers ModelOutput works). loss_fn autopar.cross_entropy on a model that returns its
  router's load-balancing loss gets the model's coefficient bound (autopar.losses.bind_aux_loss).
Guarantees: `Captured.gm` is an FX GraphModule in ATen training IR whose nodes carry
  meta[VAL] (FakeTensor: shape/dtype), meta[NN_MODULE_STACK] (the module path of the
  user's code, prefixed by `Captured.prefix`), meta[STACK_TRACE] (user source line) — torch's
  keys, listed in passes/meta.py;
  parameters and buffers are get_attr nodes with the user's fully qualified names (plus the
  prefix), so a state dict maps 1:1.
  With `repeat_limit=r`, every repeated block container (found structurally: a ModuleList /
  Sequential whose children have one class; an encoder-decoder model has one per stack) is
  cut to its first r children plus the first child of every other parameter layout (a dense
  first layer before MoE layers) for the export and restored afterwards; `Captured.repeats`
  records the true lengths and gm.meta[REPEATS] the same by graph path (with the prefix), and
  gm.meta[REPEAT_KEYS] the kept child each true child stands for, for passes/layers.py.
  Planning uses r = 2 (one block is analysed, two prove the repetition); compiling uses the full
  graph (repeat_limit=None). A cut model whose export fails, or calls a kept child more than
  once (it loops over its blocks or slices them by index: `calls_a_kept_child_again`), is
  exported whole instead.
  With `compute_dtype=torch.bfloat16` (a 16-bit run), the model is traced with its floating
  parameters in that dtype (uninitialised stand-ins: export reads shapes, not values; buffers
  keep their dtype, as the runtime's MixedPrecision leaves them), so the graph is the one the
  run executes: a norm's `x.float()` is a real cast, distinct from x (traced on fp32 weights it
  returns x itself, and export records every later use of x as a use of the cast), and the
  dtypes export bakes in (`_assert_tensor_metadata`, `to(input_dtype)`) are the run's. After
  the trace the graph's parameters are the user's own tensors again (fp32: the masters start
  from them); their meta[VAL] says the compute dtype. None / fp32: traced as the model is.
Errors: a model torch.export cannot trace raises `CaptureError` naming the user's source line,
  the original error and a fix.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import sysconfig
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.fx

from autopar.losses import bind_aux_loss
from autopar.passes import meta as K


class CaptureError(ValueError):
    """torch.export could not trace the model; the message names the user's line and a fix."""


class _WithLoss(torch.nn.Module):
    """Wraps model + loss_fn so the exported graph ends in the scalar loss."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor] | None,
                 keywords: tuple[str, ...] = ()):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.keywords = tuple(keywords)   # the last inputs go to the model by these names

    def forward(self, *args: Any) -> Any:
        inputs, targets = (args, None) if self.loss_fn is None else (args[:-1], args[-1])
        k = len(self.keywords)
        named = dict(zip(self.keywords, inputs[len(inputs) - k:]))
        out = self.model(*inputs[:len(inputs) - k], **named)
        return out if self.loss_fn is None else self.loss_fn(out, targets)


@dataclass
class Captured:
    """The captured program. `gm` is runnable (same numerics as the model).

    repeats: {container path in the user's model (no prefix): true number of children} for
    every container that `repeat_limit` truncated; empty for a full capture.
    """
    gm: torch.fx.GraphModule
    exported: torch.export.ExportedProgram
    model: torch.nn.Module
    has_loss: bool
    prefix: str  # module-path prefix added by the loss wrapper ("model.")
    example_inputs: tuple = ()
    targets: torch.Tensor | None = None
    repeats: dict[str, int] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        """Batch size of the example (dim 0 of the first tensor input)."""
        first = next(a for a in self.example_inputs if torch.is_tensor(a))
        return int(first.shape[0]) if first.dim() else 1


def capture(model: torch.nn.Module, example_inputs: tuple, loss_fn: Callable | None = None,
            targets: torch.Tensor | None = None, *, repeat_limit: int | None = None,
            compute_dtype: torch.dtype | None = None, keywords: tuple[str, ...] = ()) -> Captured:
    """torch.export (non-strict) of `model` (+ `loss_fn(model(*inputs), targets)`).

    keywords: the last len(keywords) example inputs are passed to the model by these names
    (packed documents' position_ids and attention_mask, autopar/documents.py); the graph takes
    them as positional inputs in the same order.

    If loss_fn is given without targets, language-model targets are made: zeros shaped like the
    first input (token ids), which is all the graph needs (shapes, not values).
    compute_dtype: the dtype the run computes in (module docstring); None or fp32: the model's.
    """
    if compute_dtype is not None and compute_dtype != torch.float32:
        if not compute_dtype.is_floating_point:
            raise ValueError(f"capture: compute_dtype={compute_dtype}: must be a floating "
                             f"dtype (torch.bfloat16 for mixed precision) or None")
        with parameters_as(model, compute_dtype) as originals:
            captured = capture(model, example_inputs, loss_fn, targets,
                               repeat_limit=repeat_limit, keywords=keywords)
        _rebind_parameters(captured.gm, originals)
        return captured
    example_inputs = _check_inputs(model, example_inputs, loss_fn, targets, repeat_limit)
    if loss_fn is not None and targets is None:
        targets = _default_targets(example_inputs)
    if targets is not None and any(torch.is_tensor(a) and a.is_meta for a in example_inputs):
        targets = targets.to("meta")
    if targets is not None and any(targets is a for a in example_inputs):
        targets = targets.clone()  # export would merge the two into one graph input
    wrapper = _WithLoss(model, bind_aux_loss(model, loss_fn), keywords)   # + the router's loss
    args = tuple(example_inputs) + ((targets,) if loss_fn is not None else ())
    kept: dict[str, tuple[str, ...]] = {}
    prefix = "model."   # the loss wrapper holds the user's model as `model`
    if repeat_limit is not None:
        try:
            with truncate_repeats(model, repeat_limit) as kept:
                exported = _export(wrapper, args)
        except CaptureError:
            kept = {}  # truncation broke the model (it may index its blocks): export it whole
            exported = _export(wrapper, args)
        if kept and calls_a_kept_child_again(exported.graph_module, kept, prefix):
            kept = {}  # its blocks run other than once each in order: export it whole
            exported = _export(wrapper, args)
    else:
        exported = _export(wrapper, args)
    gm = exported.module()
    repeats = {path: len(keys) for path, keys in kept.items()}
    gm.meta[K.REPEATS] = {(prefix + path).rstrip("."): n for path, n in repeats.items()}
    gm.meta[K.REPEAT_KEYS] = {(prefix + path).rstrip("."): keys for path, keys in kept.items()}
    return Captured(gm=gm, exported=exported, model=model, has_loss=loss_fn is not None,
                    prefix=prefix, example_inputs=tuple(example_inputs), targets=targets,
                    repeats=dict(repeats))


# ----- repeated containers ---------------------------------------------------------------------

def calls_a_kept_child_again(gm: torch.fx.GraphModule, kept: dict[str, tuple[str, ...]],
                             prefix: str) -> bool:
    """Whether a truncated export called a kept child of a cut container more than once
    (torch.export's "@k" on its module-stack key): REPEAT_KEYS stand for one call of each
    true child, so a model that loops over its blocks or slices its container by its config's
    indices (Dory's recurrent section: `layers[start:end]` run n times, on a cut list the
    wrong blocks) is not what the cut graph shows, and is exported whole."""
    children = {f"{prefix}{path}.{key}".replace("..", ".") for path, keys in kept.items()
                for key in set(keys)}
    for node in gm.graph.nodes:
        for stack_key, value in (node.meta.get(K.NN_MODULE_STACK) or {}).items():
            if CALL_COUNT.search(stack_key) and value[0] in children:
                return True
    return False


# torch.export's mark of a module's repeated call on its module-stack key ("...@1", "@2": the
# first call has none); passes/layers.py numbers call paths by it
CALL_COUNT = re.compile(r"@\d+$")


def find_repeated_containers(model: torch.nn.Module) -> dict[str, int]:
    """{path: len} of the outermost ModuleList/Sequential containers of ≥2 children of one
    class (their parameters may differ: dense and MoE layers of one stack are one class).
    Structural: attribute names are never consulted."""
    found: dict[str, int] = {}
    for path, module in model.named_modules():
        if any(path == p or path.startswith(p + ".") for p in found):
            continue  # inside a repeated block: its own lists (e.g. experts) stay whole
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        children = list(module.children())
        if len(children) >= 2 and len({type(c) for c in children}) == 1:
            found[path] = len(children)
    return found


def kept_children(container: torch.nn.Module, limit: int) -> tuple[str, ...]:
    """For every child of `container`, the key of the kept child that stands for it: the first
    `limit` children stand for themselves, every later one for the first child of its layout,
    which is kept too. A layout is the child's parameters (names, shapes, dtypes) and the plain
    settings of its modules (bool / int / float / str / None attributes) that vary over the
    children, but for a running index (0, 1, 2, ...: a layer number): a dense first layer
    before MoE layers, a layer without rotary (SmolLM3's use_rope) or with a sliding window
    (Cohere2). So a truncated stack still holds one block of every layout and the true order
    of layouts; the graph (passes/layers.py) decides which layouts are kinds."""
    keys = list(container._modules)
    settings = [_settings(container._modules[k]) for k in keys]
    varying = {a for a in set().union(*settings)
               if len({repr(s.get(a)) for s in settings}) > 1}
    index = {a for a in varying if all(type(s.get(a)) is int for s in settings)
             and [s[a] - settings[0][a] for s in settings] == list(range(len(keys)))}
    chosen = sorted(varying - index)
    first_of: dict[tuple, str] = {}
    layouts = []
    for key, s in zip(keys, settings):
        layout = (_signature(container._modules[key]), tuple(repr(s.get(a)) for a in chosen))
        layouts.append(layout)
        first_of.setdefault(layout, key)
    return tuple(key if j < limit else first_of[layouts[j]] for j, key in enumerate(keys))


def _settings(module: torch.nn.Module) -> dict[tuple[str, str], Any]:
    """{(submodule path, attribute): value} of the plain settings of `module`'s modules."""
    out = {}
    for path, sub in module.named_modules():
        for name, value in vars(sub).items():
            if not name.startswith("_") and name != "training" and (
                    value is None or isinstance(value, (bool, int, float, str))):
                out[(path, name)] = value
    return out


def _signature(module: torch.nn.Module) -> tuple:
    """(name, shape, dtype) of each parameter of `module`."""
    return tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters())


@contextlib.contextmanager
def truncate_repeats(model: torch.nn.Module, limit: int
                     ) -> Iterator[dict[str, tuple[str, ...]]]:
    """Temporarily keep only the children of each repeated container that `kept_children`
    names (in place, so the model's own references to the container still work; the kept
    children keep their keys); yields {path: the kept key of every true child} for the
    containers actually cut. Restores the children on exit, also on error."""
    saved: list[tuple[torch.nn.Module, dict]] = []
    cut: dict[str, tuple[str, ...]] = {}
    try:
        for path in find_repeated_containers(model):
            container = model.get_submodule(path) if path else model
            keys = kept_children(container, limit)
            if len(set(keys)) == len(keys):
                continue
            original = dict(container._modules)
            saved.append((container, original))
            container._modules = {k: m for k, m in original.items() if k in set(keys)}
            cut[path] = keys
        yield cut
    finally:
        for container, original in saved:
            container._modules = original


# ----- the compute dtype ------------------------------------------------------------------------

@contextlib.contextmanager
def parameters_as(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[dict[int, Any]]:
    """Temporarily replace every floating parameter of `model` by an uninitialised stand-in of
    `dtype` (same shape, device and requires_grad; one stand-in per tensor, so tied weights stay
    tied); yields {id(stand-in): the user's parameter}. Restores the parameters on exit, also on
    error. Only shapes reach torch.export, so the stand-ins need no values (and a meta model's
    stay meta)."""
    stand_ins: dict[int, torch.nn.Parameter] = {}
    saved: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
    try:
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is None or not p.is_floating_point() or p.dtype == dtype:
                    continue
                if id(p) not in stand_ins:
                    stand_ins[id(p)] = torch.nn.Parameter(torch.empty_like(p, dtype=dtype),
                                                          requires_grad=p.requires_grad)
                saved.append((module, name, p))
                module._parameters[name] = stand_ins[id(p)]
        yield {id(stand_ins[id(p)]): p for _, _, p in saved}
    finally:
        for module, name, p in reversed(saved):
            module._parameters[name] = p


def _rebind_parameters(gm: torch.fx.GraphModule, originals: dict[int, Any]) -> None:
    """The graph's stand-in parameters (parameters_as) become the user's tensors again, under
    every name (tied weights too); the nodes keep the compute dtype in meta[VAL]."""
    for qual, p in list(gm.named_parameters(remove_duplicate=False)):
        if id(p) in originals:
            owner, _, leaf = qual.rpartition(".")
            (gm.get_submodule(owner) if owner else gm)._parameters[leaf] = originals[id(p)]


# ----- export and its errors -------------------------------------------------------------------

def _export(wrapper: torch.nn.Module, args: tuple) -> torch.export.ExportedProgram:
    # torch prints the partial graph (~50 lines) and a symbolic-shapes warning to stderr before
    # raising on a data-dependent branch: held back, and shown only if export succeeds
    held = io.StringIO()
    shapes_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = shapes_log.level
    try:
        shapes_log.setLevel(logging.ERROR)
        with contextlib.redirect_stderr(held):
            exported = torch.export.export(wrapper, args, strict=False)
        sys.stderr.write(held.getvalue())
        return exported
    except Exception as exc:  # torch.export raises many types; all become one clear error
        # One line on screen, the detail in __cause__: the innermost original error with its
        # traceback cut to start at the user's frame (torch.export's own chain of wrappers
        # would otherwise print hundreds of lines before this message).
        raise CaptureError(_explain_failure(exc)) from _short_root(exc)
    finally:
        shapes_log.setLevel(level)


def _explain_failure(exc: BaseException) -> str:
    where = _user_frame(exc)
    location = f"{where.filename}:{where.lineno} ({where.name}: {(where.line or '').strip()})" \
        if where else "no frame outside torch/autopar (see the cause)"
    root = _root(exc)
    first_line = str(root).strip().splitlines()[0] if str(root).strip() else ""
    return (f"autopar could not capture the model with torch.export (non-strict): "
            f"{type(root).__name__}: {first_line} — at {location}; fix: {_suggest_fix(exc)}")


def _root(exc: BaseException) -> BaseException:
    """The innermost exception of exc's chain (causes, then contexts)."""
    seen: set[int] = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        nxt = exc.__cause__ or exc.__context__
        if nxt is None:
            break
        exc = nxt
    return exc


def _short_root(exc: BaseException) -> BaseException:
    """_root(exc) with its traceback starting at the user's innermost frame, when there is one."""
    root = _root(exc)
    where = _user_frame(root)
    tb, keep = root.__traceback__, None
    while tb is not None:
        if where is not None and tb.tb_frame.f_code.co_filename == where.filename \
                and tb.tb_lineno == where.lineno:
            keep = tb
        tb = tb.tb_next
    if keep is not None:
        root = root.with_traceback(keep)
    return root


def _suggest_fix(exc: BaseException) -> str:
    text = f"{type(exc).__name__} {exc}".lower()
    if any(k in text for k in ("data-dependent", "datadependent", "guardondatadependent",
                               "could not guard", "could not extract specialized integer",
                               ".item()", "symbool", "unbacked")):
        return ("the model branches on or converts tensor VALUES (`if x.sum() > 0:`, .item(), "
                ".tolist(), bool(tensor)); the graph must be the same for every input: use "
                "torch.where / torch.cond for value-dependent choices, and take sizes from "
                ".shape, not from tensor contents")
    if "device" in text and ("meta" in text or "expected all tensors" in text):
        return ("the model and the example inputs must be on the same device: a model built "
                "under torch.device('meta') needs example inputs with device='meta'")
    if "dtype" in text or "expected scalar type" in text:
        return "check the dtypes of the example inputs (token ids must be torch.long)"
    if "shape" in text or "size mismatch" in text or "must match the size" in text:
        return ("the example inputs have a shape the model rejects: run model(*example_inputs) "
                "once outside autopar to check them (e.g. sequence longer than the position table)")
    return ("run model(*example_inputs) (and loss_fn) outside autopar to check they work; "
            "arbitrary Python is fine (export is non-strict), but the traced tensor program "
            "must not depend on tensor values")


_SKIP_DIRS = tuple(os.path.realpath(p) + os.sep for p in (
    os.path.dirname(torch.__file__),
    os.path.dirname(__file__),                                   # autopar.passes
    os.path.join(os.path.dirname(os.path.dirname(__file__)), "autopar"),
    os.path.join(os.path.dirname(os.path.dirname(__file__)), "cost"),
    sysconfig.get_paths()["stdlib"],
))


def _user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """Innermost frame of the user's code over the exception and its causes."""
    best = None
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        for frame in traceback.extract_tb(exc.__traceback__):
            path = os.path.realpath(frame.filename)
            if not path.startswith(_SKIP_DIRS) and not frame.filename.startswith("<"):
                best = frame  # later frames are deeper
        if best is not None:
            return best
        exc = exc.__cause__ or exc.__context__
    return best


# ----- input checks ----------------------------------------------------------------------------

def _check_inputs(model: Any, example_inputs: Any, loss_fn: Any, targets: Any,
                  repeat_limit: int | None) -> tuple:
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"capture: model is a {type(model).__name__}; it must be a "
                         f"torch.nn.Module")
    if torch.is_tensor(example_inputs):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)) or not any(
            torch.is_tensor(a) for a in example_inputs):
        raise ValueError(f"capture: example_inputs={type(example_inputs).__name__} must be a "
                         f"tuple of tensors, e.g. (input_ids,)")
    if targets is not None and loss_fn is None:
        raise ValueError("capture: targets were given without loss_fn; pass loss_fn (e.g. "
                         "autopar.cross_entropy) or drop the targets")
    if repeat_limit is not None and (not isinstance(repeat_limit, int) or repeat_limit < 2):
        raise ValueError(f"capture: repeat_limit={repeat_limit!r} must be an integer >= 2 "
                         f"(two blocks are needed to recognise a repeated block) or None")
    if any(p.is_meta for p in model.parameters()):
        # a meta model plans from shapes only: meet it on the meta device
        example_inputs = [a.to("meta") if torch.is_tensor(a) else a for a in example_inputs]
    return tuple(example_inputs)


def _default_targets(example_inputs: tuple) -> torch.Tensor:
    first = next(a for a in example_inputs if torch.is_tensor(a))
    if first.dtype not in (torch.long, torch.int32, torch.int64):
        raise ValueError(f"capture: loss_fn given without targets and the first input has "
                         f"dtype {first.dtype}, so language-model targets cannot be made; "
                         f"pass targets explicitly")
    return torch.zeros_like(first, dtype=torch.long)
