"""Step caching for the H3 DiT: skip the block stack on steps where it would barely change, reuse its residual.

One sampling step is one DiT forward over one packed sequence (text, condition, audio and video rows together), so
every decision here is taken once per forward for the whole sequence: audio and video are cached or computed
together and stay in step. Presets (`--cache`, the Sampler's `cache` widget):

    off        nothing installed: bitwise today's result
    quality    cache-dit's DBCache (below), cautious: long warm-up, low threshold, at most 2 cached steps in a row
    balanced   DBCache with TaylorSeer (order 1) extrapolating the cached residual
    fast       DBCache, SGLang's Cache-DiT threshold (0.24), TaylorSeer order 1
    every:K    the whole block stack every K-th forward (the first included); in between, the stack's residual from
               the last computed forward is added to the stack's input. Deterministic whatever the weights.
    dbcache:fn=1,bn=1,warmup=4,threshold=0.12,max_continuous=3,max_cached=-1,taylorseer=1   (expert form)

DBCache (cache-dit, `pip install cache-dit==1.5.3` or the pack's `[cache]` extra): the first `fn` blocks always run;
when the relative L1 change of their residual since the last computed forward is under `threshold`, the middle
blocks are skipped and their cached residual (TaylorSeer-extrapolated when asked) is added; the last `bn` blocks
always run. No caching in the first `warmup` forwards, nor after `max_continuous` cached forwards in a row. The
maths is cache-dit's; this module only describes H3's block to it (`ForwardPattern.Pattern_3`: hidden states in,
hidden states out, the rest positional). `every:K` has no library form (cache-dit always computes at least one
block), so it is a small diffusers hook (`_EveryKHead` / `_EveryKBlock`) on diffusers' own hook machinery, with
H3's block listed in diffusers' `TransformerBlockRegistry` (which also lets diffusers' FirstBlockCache or MagCache
run on H3).

Skipped blocks are never called, so their streaming hooks (`--offload block`: diffusers' group offloading; ComfyUI's
per-layer weight casting) never fetch their weights. On CUDA, group offloading also prefetches the *next* block
while one runs; a link from an always-computed module into a skippable block would fetch a block the step then
skips, so those links are cut for the run (`_prefetch_cut`) and the first skippable block loads itself.

`applied(...)` counts block passes: `computed` blocks that really ran out of `total` = forwards x blocks.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from dataclasses import dataclass, fields, replace
from typing import Callable, Iterator

import torch

from . import diffusers_adapter
from .rules import H3InputError

OFF = "off"
CACHE_DIT_REQUIREMENT = "cache-dit==1.5.3"


@dataclass(frozen=True)
class DBCache:
    """cache-dit's DBCache parameters, for the released 50-block stack (`for_blocks` fits them to a shorter one)."""

    fn: int = 1  # first blocks always computed; the change of their residual decides
    bn: int = 1  # last blocks always computed (they correct the approximated hidden states)
    warmup: int = 4  # forwards at the start that are never cached
    threshold: float = 0.12  # relative L1 change of the first blocks' residual below which the middle is reused
    max_continuous: int = 3  # cached forwards in a row at most (-1: no cap)
    max_cached: int = -1  # cached forwards in a run at most (-1: no cap)
    taylorseer: int = 0  # TaylorSeer order extrapolating the cached residual (0: off, 1 or 2)

    def __post_init__(self):
        if self.fn < 1 or self.bn < 0 or self.warmup < 0 or not self.threshold > 0:
            raise H3InputError(f"dbcache needs fn >= 1, bn >= 0, warmup >= 0 and threshold > 0, got {self}")
        if self.taylorseer not in (0, 1, 2):
            raise H3InputError(f"dbcache taylorseer is an order 0 (off), 1 or 2, got {self.taylorseer}")

    def for_blocks(self, blocks: int) -> "DBCache":
        """Keep at least one skippable block: on a stack shorter than fn + bn + 1, bn (then fn) shrinks."""
        if blocks < 2:
            raise H3InputError(f"step caching needs a DiT of at least 2 blocks, this one has {blocks}")
        fn = min(self.fn, blocks - 1)
        return replace(self, fn=fn, bn=max(0, min(self.bn, blocks - fn - 1)))


@dataclass(frozen=True)
class EveryK:
    k: int  # the block stack runs on forwards 0, k, 2k, ...


Plan = DBCache | EveryK | None

PRESETS: dict[str, DBCache] = {
    "quality": DBCache(fn=1, bn=1, warmup=8, threshold=0.08, max_continuous=2),
    "balanced": DBCache(fn=1, bn=1, warmup=4, threshold=0.12, max_continuous=3, taylorseer=1),
    "fast": DBCache(fn=1, bn=1, warmup=4, threshold=0.24, max_continuous=3, taylorseer=1),
}
#: What the Sampler's `cache` widget offers (the CLI takes any `every:K` and the `dbcache:` expert form too).
CHOICES = (OFF, *PRESETS, "every:2", "every:3", "every:4")

_EXPERT_KEYS = {f.name: f.type for f in fields(DBCache)}
_USAGE = ("cache must be off, quality, balanced, fast, every:K (an integer K >= 2) or "
          f"dbcache:key=value,... with keys {', '.join(_EXPERT_KEYS)}")


def parse(spec: str | None) -> Plan:
    """The plan a `--cache` / widget string names; None for `off`. Bad strings raise H3InputError naming the forms."""
    text = OFF if spec is None else str(spec).strip().lower()
    if text == OFF:
        return None
    if text in PRESETS:
        return PRESETS[text]
    head, _, rest = text.partition(":")
    if head == "every":
        if not rest.isdigit() or int(rest) < 2:
            raise H3InputError(f"{_USAGE}; every:K needs an integer K >= 2, got {spec!r}")
        return EveryK(int(rest))
    if head == "dbcache":
        values = {}
        for item in filter(None, rest.split(",")):
            key, _, value = item.partition("=")
            key = key.strip()
            if key not in _EXPERT_KEYS or not value.strip():
                raise H3InputError(f"{_USAGE}; {item!r} is not key=value with a known key")
            try:
                values[key] = float(value) if key == "threshold" else int(value)
            except ValueError:
                raise H3InputError(f"{_USAGE}; {key} must be a number, got {value!r}") from None
        return DBCache(**values)
    raise H3InputError(f"{_USAGE}; got {spec!r}")


@dataclass
class Passes:
    """Block passes of one run: `computed` blocks really ran out of `total` (= DiT forwards x blocks)."""

    blocks: int
    forwards: int = 0
    computed: int = 0

    @property
    def total(self) -> int:
        return self.forwards * self.blocks

    @property
    def skipped_percent(self) -> int:
        """Share of the DiT's block runs the cache skipped, in whole percent (0 before any forward)."""
        return round(100 * (self.total - self.computed) / self.total) if self.total else 0

    def __str__(self) -> str:  # in a ComfyUI user's words: the Sampler's progress text and `generate`'s log
        return f"computed {self.computed} of {self.total} DiT block runs ({self.skipped_percent}% skipped)"


PassesFn = Callable[[Passes], None]


# --- hooks (diffusers' hook machinery) ------------------------------------------------------------------------------

_COUNT_HOOK, _EVERY_HEAD_HOOK, _EVERY_BLOCK_HOOK = "h3_block_pass_count", "h3_every_k_head", "h3_every_k_block"


def _hook_classes():
    from diffusers.hooks import ModelHook

    base_state, _ = diffusers_adapter.hook_state_classes()

    class PassCount(ModelHook):
        """Counts the block's real runs: registered below the skipping hooks, it runs only when the block does."""

        def __init__(self, passes: Passes):
            super().__init__()
            self.passes = passes

        def pre_forward(self, module, *args, **kwargs):
            self.passes.computed += 1
            return args, kwargs

    class EveryKState(base_state):
        def __init__(self):
            self.forward = 0  # forwards seen in this context
            self.compute = True  # whether this forward runs the stack
            self.stack_input = None  # hidden states entering the stack on a computed forward
            self.residual = None  # the stack's output minus its input, from the last computed forward

        def reset(self):
            self.__init__()

    class EveryKBlock(ModelHook):
        """Any block after the first: identity on a cached forward (the head already added the stack's residual);
        the last block records the residual on a computed one."""

        _is_stateful = True

        def __init__(self, state_manager, metadata, is_tail: bool):
            super().__init__()
            self.state_manager, self.metadata, self.is_tail = state_manager, metadata, is_tail

        def new_forward(self, module, *args, **kwargs):
            state = self.state_manager.get_state()
            if not state.compute:
                return self.metadata._get_parameter_from_args_kwargs("hidden_states", args, kwargs)
            output = self.fn_ref.original_forward(*args, **kwargs)
            if self.is_tail:
                state.residual, state.stack_input = output - state.stack_input, None
            return output

        def reset_state(self, module):
            self.state_manager.reset()
            return module

    class EveryKHead(EveryKBlock):
        """The first block decides for the whole stack (and so for the whole packed sequence). The decision is the
        forward's number alone, so under sequence parallelism every rank takes the same one."""

        def __init__(self, state_manager, metadata, is_tail: bool, k: int, splits: list):
            super().__init__(state_manager, metadata, is_tail)
            self.k, self.splits = k, splits

        def rank_rows(self, module, args, kwargs) -> torch.Tensor:
            """The stack's input rows this rank computes. Under sequence parallelism the context-parallel plan's
            split hooks on the first block sit inside this one (registered when the DiT was parallelised): they see
            the whole packed sequence and hand the block this rank's shard, which every later block and the tail's
            output keep. The residual is cached per shard, so the input is split here the same way (a local
            `tensor_split`, no collective); with no split hooks it is the whole sequence."""
            kwargs = dict(kwargs)
            for split in self.splits:  # outermost first, as the chain runs them
                args, kwargs = split.pre_forward(module, *args, **kwargs)
            return self.metadata._get_parameter_from_args_kwargs("hidden_states", args, kwargs)

        def new_forward(self, module, *args, **kwargs):
            state = self.state_manager.get_state()
            hidden = self.rank_rows(module, args, kwargs)
            state.compute = state.forward % self.k == 0 or state.residual is None
            state.forward += 1
            if not state.compute:
                return hidden + state.residual
            state.stack_input = hidden
            return super().new_forward(module, *args, **kwargs)

    return PassCount, EveryKState, EveryKBlock, EveryKHead


@contextlib.contextmanager
def _registered(module: torch.nn.Module, hook, name: str) -> Iterator[None]:
    from diffusers.hooks import HookRegistry

    registry = HookRegistry.check_if_exists_or_initialize(module)
    registry.register_hook(hook, name)
    try:
        yield
    finally:
        registry.remove_hook(name, recurse=False)


@contextlib.contextmanager
def _every_k(transformer: torch.nn.Module, k: int) -> Iterator[None]:
    _, state_cls, block_cls, head_cls = _hook_classes()
    _, state_manager_cls = diffusers_adapter.hook_state_classes()
    metadata = diffusers_adapter.register_h3_block()
    blocks = list(transformer.transformer_blocks)
    states = state_manager_cls(state_cls)
    splits = diffusers_adapter.context_parallel_split_hooks(blocks[0])
    with contextlib.ExitStack() as stack:
        for index, block in enumerate(blocks):
            tail = index == len(blocks) - 1
            hook = head_cls(states, metadata, tail, k, splits) if index == 0 else block_cls(states, metadata, tail)
            stack.enter_context(_registered(block, hook, _EVERY_HEAD_HOOK if index == 0 else _EVERY_BLOCK_HOOK))
        from diffusers.hooks import HookRegistry

        HookRegistry.check_if_exists_or_initialize(transformer).invalidate_child_registries_cache()
        with transformer.cache_context("h3"):
            yield


def _cache_dit():
    # cache-dit logs every patch at INFO on its own handler; the pack's CLI and ComfyUI logs stay readable.
    os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "error")
    try:
        import cache_dit
    except ImportError:
        raise H3InputError(f"cache presets quality, balanced, fast and dbcache:... need cache-dit: pip install "
                           f"{CACHE_DIT_REQUIREMENT} (every:K needs nothing extra)") from None
    return cache_dit


@contextlib.contextmanager
def _dbcache(transformer: torch.nn.Module, plan: DBCache, forwards: int) -> Iterator[None]:
    cache_dit = _cache_dit()
    plan = plan.for_blocks(len(transformer.transformer_blocks))
    # H3's denoiser passes the layout tensors the forward's signature names; cache-dit's replacement forward is
    # (*args, **kwargs), so the original signature is put back on it.
    signature = inspect.signature(transformer.forward)
    forward_before = transformer.__dict__.get("forward")  # a hook's instance forward (group offloading), or None
    config = cache_dit.DBCacheConfig(
        Fn_compute_blocks=plan.fn, Bn_compute_blocks=plan.bn, residual_diff_threshold=plan.threshold,
        max_warmup_steps=plan.warmup, max_continuous_cached_steps=plan.max_continuous,
        max_cached_steps=plan.max_cached, num_inference_steps=forwards, enable_separate_cfg=False)
    calibrator = cache_dit.TaylorSeerCalibratorConfig(taylorseer_order=plan.taylorseer) if plan.taylorseer else None
    adapter = cache_dit.BlockAdapter(transformer=transformer, blocks=transformer.transformer_blocks,
                                     forward_pattern=cache_dit.ForwardPattern.Pattern_3, check_forward_pattern=True)
    cache_dit.enable_cache(adapter, cache_config=config, calibrator_config=calibrator)
    try:
        transformer.forward.__signature__ = signature
        yield
    finally:
        # cache-dit re-binds the saved forward with `__get__`, which a hook's forward (a partial) lacks: the
        # forward is put back here instead, after cache-dit has dropped its contexts and marks.
        transformer.__dict__.pop("_original_forward", None)
        cache_dit.disable_cache(transformer)
        if forward_before is None:
            transformer.__dict__.pop("forward", None)
        else:
            transformer.forward = forward_before


def _skippable(plan: Plan, blocks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    if isinstance(plan, EveryK):
        return blocks
    if isinstance(plan, DBCache):
        plan = plan.for_blocks(len(blocks))
        return blocks[plan.fn:len(blocks) - plan.bn]
    return []


@contextlib.contextmanager
def _prefetch_cut(transformer: torch.nn.Module, skippable: list[torch.nn.Module]) -> Iterator[None]:
    """Cut group offloading's prefetch links from a module that always runs into a block a step may skip (CUDA
    streams only: the links are made after the first forward), and restore them at the end."""
    skippable_ids = {id(block) for block in skippable}
    cut: list[tuple[object, object]] = []

    def cut_links():
        for module in transformer.modules():
            if id(module) in skippable_ids:
                continue
            for hook in diffusers_adapter.hooks_of(module):
                group = diffusers_adapter.prefetched_group(hook)
                if group is not None and id(diffusers_adapter.group_leader(group)) in skippable_ids:
                    cut.append((hook, group))
                    diffusers_adapter.set_prefetch(hook, group, linked=False)

    handles = [transformer.register_forward_pre_hook(lambda *_: cut_links()),
               transformer.register_forward_hook(lambda *_: cut_links())]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for hook, group in reversed(cut):
            diffusers_adapter.set_prefetch(hook, group, linked=True)


@contextlib.contextmanager
def applied(transformer: torch.nn.Module, plan: Plan, forwards: int,
            on_forward: PassesFn | None = None) -> Iterator[Passes]:
    """Run `transformer` under `plan` for one sampling run of `forwards` DiT forwards; yields the live pass count.

    `plan=None` installs nothing on the model (bitwise today's result) and counts with plain forward hooks."""
    blocks = list(transformer.transformer_blocks)
    passes = Passes(blocks=len(blocks))

    def forward_done(*_):
        passes.forwards += 1
        if on_forward is not None:
            on_forward(passes)

    with contextlib.ExitStack() as stack:
        handle = transformer.register_forward_hook(forward_done)
        stack.callback(handle.remove)
        if plan is None:
            def count(*_):
                passes.computed += 1

            for block in blocks:
                stack.callback(block.register_forward_pre_hook(count).remove)
            yield passes
            return
        pass_count, *_ = _hook_classes()
        for block in blocks:  # below the skipping hooks: counts only real runs
            stack.enter_context(_registered(block, pass_count(passes), _COUNT_HOOK))
        stack.enter_context(_prefetch_cut(transformer, _skippable(plan, blocks)))
        if isinstance(plan, EveryK):
            stack.enter_context(_every_k(transformer, plan.k))
        else:
            stack.enter_context(_dbcache(transformer, plan, forwards))
        yield passes
