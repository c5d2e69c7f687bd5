"""Forward hooks, installed only on modules that some live invoke needs.

Each hooked (module, family) pair remembers its owners (request ids); when the last owner finishes,
the hook is removed, so a step with no interventions runs vLLM's model untouched.
"""

from __future__ import annotations

from typing import Any, Callable

from interlace.workers.points import Point, ModuleTree

OnPoint = Callable[[str, str, Any], Any]  # (module, family, hooked value) -> value


class HookSet:
    def __init__(self, tree: ModuleTree, samples_slot, on_point: OnPoint):
        self.tree = tree
        self.samples_slot = samples_slot  # runner_hooks.CallbackSlot around the runner's sampling
        self.on_point = on_point
        self._handles: dict[tuple[str, str], Any] = {}
        self._owners: dict[tuple[str, str], set[str]] = {}

    def want(self, point: Point, owner: str) -> None:
        # Enclosing modules are hooked too: PyTorch decides whether a module has hooks when the
        # module is called, so a program that asks for mlp.output from inside mlp (after reading
        # mlp.down_proj) is only served if mlp was hooked before it started.
        key = hook_of(point)
        if owner in self._owners.get(key, ()):  # hooked for it already, with its ancestors
            return
        for k in [key, *((a, "output") for a in _ancestors(point.module))]:
            if k not in self._handles:
                self._handles[k] = self._install(*k)
            self._owners.setdefault(k, set()).add(owner)

    def release(self, owner: str) -> None:
        for key in [k for k, owners in self._owners.items() if owner in owners]:
            owners = self._owners[key]
            owners.discard(owner)
            if not owners:
                self._handles.pop(key).remove()
                del self._owners[key]

    @property
    def wanted(self) -> dict[tuple[str, str], set[str]]:
        """The hooked (module, family) pairs, each with its owners (read, never changed)."""
        return self._owners

    @property
    def installed(self) -> list[tuple[str, str]]:
        return sorted(self._handles)

    def _install(self, module: str, family: str):
        on_point = self.on_point
        if family == "input":
            return self.tree.modules[module].register_forward_pre_hook(
                lambda _m, args: on_point(module, "input", args)
            )
        if family == "samples":  # V2's sampler is no nn.Module: the runner adapter exposes a slot
            return self.samples_slot.set(lambda out: on_point(module, family, out))
        if family == "logits":
            target = self.tree.modules.get("logits_processor")
        else:
            target = self.tree.modules[module]
        if target is None:
            raise AttributeError(f"this model has no {family!r} module to hook")
        return target.register_forward_hook(lambda _m, _args, out: on_point(module, family, out))


def _ancestors(module: str) -> list[str]:
    parts = module.split(".") if module else []
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def hook_of(point: Point) -> tuple[str, str]:
    """The (module, family) hook that serves ``point``."""
    if point.kind == "input":
        return (point.module, "input")
    if point.kind in ("logits", "samples"):
        return ("", point.kind)
    return (point.module, "output")  # output, resid and final all read the module's output
