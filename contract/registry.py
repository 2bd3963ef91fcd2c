"""The records every installed plugin registers, each with the plugin and distribution that registered it."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Iterable

from .record import KernelRecord


@dataclass
class Registered:
    """A record with the plugin and distribution that registered it (what `--only` may name)."""

    record: KernelRecord | None
    plugin: str
    distribution: str | None
    error: str = ""  # the plugin's hook failed, or returned something that is not a KernelRecord

    def names(self) -> list[str]:
        out = [self.plugin]
        if self.record is not None:
            out += [self.record.name, self.record.family]
        if self.distribution:
            out += [self.distribution, self.distribution.replace("-", "_")]
        return [n.lower() for n in out]

    def matches(self, patterns: Iterable[str]) -> bool:
        return any(fnmatch.fnmatchcase(n, p.lower()) for p in patterns for n in self.names())


def discover(pm=None) -> list[Registered]:
    """Every record each installed plugin registers through `tensorfold_kernels`, in plugin order."""
    if pm is None:
        from tensorfold_core.plugins import new_plugin_manager  # core's registry: entry points of "tensorfold"

        pm = new_plugin_manager()
    dists = {id(plugin): dist for plugin, dist in pm.list_plugin_distinfo()}
    found = []
    for hookimpl in reversed(pm.hook.tensorfold_kernels.get_hookimpls()):  # pluggy keeps them last-first
        dist = dists.get(id(hookimpl.plugin))
        dist_name = dist.metadata["name"] if dist else None
        try:
            records = list(hookimpl.function() or [])
        except Exception as exc:  # a broken plugin is reported, not allowed to stop the others' proof
            found.append(Registered(None, hookimpl.plugin_name, dist_name,
                                    f"tensorfold_kernels() raised {type(exc).__name__}: {exc}"))
            continue
        for record in records:
            if isinstance(record, KernelRecord):
                found.append(Registered(record, hookimpl.plugin_name, dist_name))
            else:
                found.append(Registered(None, hookimpl.plugin_name, dist_name,
                                        f"tensorfold_kernels() returned {type(record).__name__}, not a KernelRecord"))
    return found
