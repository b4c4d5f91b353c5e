"""A tier in another process: how a tier is rebuilt from its constructor's arguments (:meth:`Portable.spec`, for the
snapshot agent). What travels when a tier is pickled (``ddp_spawn``) is each part's to say: the parts a tier holds
leave their process's state (locks, open handles, clients, counters) out of their pickled state and make it again.

:class:`Portable` is a mixin of :class:`~lightning_snapshot.backends.base.Backend` (every tier has these methods
through it); :func:`spec_class` is the checked half of :meth:`~lightning_snapshot.backends.base.Backend.from_spec`.
"""

from __future__ import annotations

import datetime as _dt
import functools
import importlib
from typing import Any

from lightning_snapshot.errors import ConfigError

__all__ = ["Portable", "spec_class"]


class Portable:
    """Records the outermost library constructor's arguments of a tier (:meth:`spec`)."""

    #: (cls, args, kwargs) of the outermost library constructor, set by ``__init_subclass__``'s wrapper
    _spec_args: tuple[type[Portable], tuple[Any, ...], dict[str, Any]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None or Portable in cls.__bases__:
            return  # (the interface itself, Backend: only the constructors of its subclasses are recorded)

        library = cls.__module__.startswith("lightning_snapshot.backends.")

        @functools.wraps(init)
        def recording_init(self: Portable, *args: Any, **kw: Any) -> None:
            # the outermost constructor of a library class is the one to replay (a user's subclass is rebuilt as
            # the library tier it extends)
            if library and not hasattr(self, "_spec_args"):
                self._spec_args = (cls, args, kw)
            init(self, *args, **kw)

        cls.__init__ = recording_init  # type: ignore[method-assign, assignment]

    def spec(self) -> dict[str, Any]:
        """How to build this tier again in another process (the snapshot agent): plain JSON values.

        It holds the constructor's arguments, ``storage_options`` included, so it is sent only to a process of the
        same user over a socket only that user can open, and never logged.
        """
        cls, args, kw = getattr(self, "_spec_args", (type(self), (), {}))

        def plain(v: Any) -> Any:
            if isinstance(v, _dt.timedelta):
                return v.total_seconds()
            if isinstance(v, (str, int, float, bool)) or v is None:
                return v
            if isinstance(v, (list, tuple)):
                return [plain(x) for x in v]
            if isinstance(v, dict):
                return {str(k): plain(x) for k, x in v.items()}
            return str(v)  # a path

        return {
            "module": cls.__module__,
            "class": cls.__qualname__,
            "args": plain(list(args)),
            "kwargs": plain(dict(kw)),
        }


def spec_class(spec: Any) -> Any:
    """What the module of a well-formed :meth:`Portable.spec` names under its class name (None if nothing).

    Raises:
        ConfigError: ``spec`` is malformed, or names a module outside ``lightning_snapshot.backends``.
    """
    if (
        not isinstance(spec, dict)
        or not isinstance(spec.get("module"), str)
        or not isinstance(spec.get("class"), str)
        or not isinstance(spec.get("args"), list)
        or not isinstance(spec.get("kwargs"), dict)
    ):
        raise ConfigError(f"malformed tier spec {spec!r}")
    if not spec["module"].startswith("lightning_snapshot.backends."):
        raise ConfigError(f"tier spec names {spec['module']!r}; only lightning_snapshot.backends tiers are accepted")
    return getattr(importlib.import_module(spec["module"]), spec["class"], None)
