"""``python -m jaxrl.sft`` / ``jaxrl.rl``: library modules, not entry points, said in one line."""

from __future__ import annotations

import sys


def refuse_main(module: str, section: str) -> None:
    """Exit 2 naming the entry point (``python -m jaxrl.train``): a script that checks exit codes
    must not believe training ran. Called under ``if __name__ == "__main__"`` before a module's
    heavy imports, so the answer comes at once."""
    print(
        f"{module} is a library module; run training with: python -m jaxrl.train --config ... "
        f"(the config's [{section}] section makes it {module.rsplit('.', 1)[1].upper()})",
        file=sys.stderr,
    )
    sys.exit(2)
