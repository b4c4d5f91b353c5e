"""A tier in another process: how a tier is rebuilt from its constructor's arguments (:meth:`Portable.spec`, for the
snapshot agent) and what travels when it is pickled (``ddp_spawn``).

:class:`Portable` is a mixin of :class:`~lightning_snapshot.backends.base.Backend` (every tier has these methods
through it); :func:`spec_class` is the checked half of :meth:`~lightning_snapshot.backends.base.Backend.from_spec`.
"""

from __future__ import annotations

import datetime as _dt
import functools
import importlib
from typing import Any, ClassVar

from lightning_snapshot.errors import ConfigError

__all__ = ["Portable", "spec_class"]


class Portable:
    """Records the outermost library constructor's arguments of a tier (:meth:`spec`) and leaves the attributes
    that belong to one process out of its pickled state (:attr:`_process_local`)."""

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

    # ------------------------------------------------------------------------------------------- pickling
    #: Attributes that belong to one process (locks, open handles, clients, counters): left out when the tier is
    #: pickled (``ddp_spawn`` pickles the trainer and its callbacks to start its processes) and made again by
    #: :meth:`_init_process_state` in the process that unpickles it. Each class lists its own; they add up.
    _process_local: ClassVar[tuple[str, ...]] = ()

    def _init_process_state(self) -> None:
        """Create this process's runtime state (the attributes of ``_process_local``); called after unpickling.
        Subclasses that have some call it from ``__init__`` too and call ``super()._init_process_state()``."""

    def __getstate__(self) -> dict[str, Any]:
        """Only the configuration travels; what belongs to this process is made again on the other side."""
        state = dict(self.__dict__)
        for klass in type(self).__mro__:
            for name in vars(klass).get("_process_local", ()):
                state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_process_state()


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
