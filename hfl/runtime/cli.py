"""``hfl-simulate``'s entry point. Runs go to hfl.runtime.simulate; what only prints a page and
exits — ``--help`` (hfl's page, conf/hydra/help/hfl.yaml), ``--hydra-help`` and Hydra's shell
completion (``-sc``, called at every Tab) — is answered by Hydra here, without the imports a run
needs (Flower, PyTorch, the strategies: 5-8 s on a 2-core machine)."""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

from omegaconf import OmegaConf

from hfl.config import schema

# Hydra's flags that never run the task: the config is composed and printed, or completion is answered.
PRINT_ONLY = frozenset({"-h", "--help", "--hydra-help", "-sc", "--shell-completion"})
# conf/ folders that are no group a user picks: the schema's typed defaults, Hydra's own groups.
HIDDEN_GROUPS = frozenset({"schema", "hydra"})
WIDTH = 100
FULL_ERROR = "HYDRA_FULL_ERROR"


def config_groups(choices: Mapping[str, Any] | None = None) -> str:
    """conf/'s config groups a user chooses from, one per line: ``group  chosen* other ...``
    (wrapped at WIDTH). Sub-folders that configs pull in themselves (algorithm/needs) and the
    HIDDEN_GROUPS are left out. ``choices``: Hydra's ``hydra.runtime.choices`` (group -> option)."""
    choices = dict(choices or {})
    groups = sorted(path for path in schema.CONF_DIR.iterdir() if path.is_dir() and path.name not in HIDDEN_GROUPS)
    width = max(len(group.name) for group in groups) + 2
    lines = []
    for group in groups:
        options = sorted(path.stem for path in group.glob("*.yaml"))
        chosen = choices.get(group.name)
        if chosen in options:
            options = [f"{chosen}*", *(option for option in options if option != chosen)]
        lines += textwrap.wrap(" ".join(options), WIDTH, initial_indent="  " + group.name.ljust(width),
                               subsequent_indent=" " * (width + 2), break_on_hyphens=False)
    return "\n".join(lines)


def register_resolvers() -> None:
    """The resolver conf/hydra/help/hfl.yaml's template uses (``${hfl.config_groups:...}``)."""
    if not OmegaConf.has_resolver("hfl.config_groups"):
        OmegaConf.register_new_resolver("hfl.config_groups", lambda choices=None: config_groups(choices))


def register_untyped() -> None:
    """Hydra's ConfigStore as schema.register fills it, but each algorithm's own schema (its
    strategy module's ``SERVER.schema``: importing it imports PyTorch) stands in as the base
    algorithm's keys and defaults, untyped. Enough to compose the config for a help page or a
    completion (same groups, options and keys; nothing is type-checked); never for a run."""
    import yaml
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(group="schema", name="config", node=schema.HflConfig, provider="hfl")
    for group, schemas in schema.SCHEMAS.items():
        for name, node in schemas.items():
            store.store(group=f"schema/{group}", name=name, node=node, provider="hfl")
    base = OmegaConf.to_container(OmegaConf.structured(schema.SCHEMAS["algorithm"]["base"]))
    for path in sorted((schema.CONF_DIR / "algorithm").glob("*.yaml")):
        for entry in (yaml.safe_load(path.read_text()) or {}).get("defaults") or []:
            found = schema.SCHEMA_ENTRY.match(entry.strip()) if isinstance(entry, str) else None
            if found and found.group(1) not in schema.SCHEMAS["algorithm"]:
                store.store(group="schema/algorithm", name=found.group(1), node=base, provider="hfl (untyped)")


def prints_only(argv: Sequence[str]) -> bool:
    """Whether Hydra answers these arguments without running anything and without the config's
    types (PRINT_ONLY flags). ``--cfg`` and ``--info`` print the config: they go the full way,
    typed, where a bad override is reported in hfl's one line."""
    return any(arg in PRINT_ONLY or arg.split("=", 1)[0] in PRINT_ONLY for arg in argv)


def _never(cfg: Any) -> None:  # Hydra only prints with PRINT_ONLY flags: no task to run
    raise AssertionError("hfl.runtime.cli: Hydra ran a task for a print-only flag")


def main() -> None:
    """``hfl-simulate``: a print-only invocation answered by Hydra from conf/ at once, any other
    one by hfl.runtime.simulate.main."""
    if prints_only(sys.argv[1:]):
        import hydra

        register_untyped()
        register_resolvers()
        # As hfl.runtime.simulate: Hydra raises what it cannot compose, and hfl-simulate says it in its words.
        ours = FULL_ERROR not in os.environ
        os.environ.setdefault(FULL_ERROR, "1")
        try:
            hydra.main(version_base="1.3", config_path=str(schema.CONF_DIR), config_name="config")(_never)()
        except Exception as exc:
            if not ours:
                raise
            raise SystemExit(f"hfl-simulate: {schema.config_error(exc) or exc}") from None
        return
    from hfl.runtime.simulate import main as simulate

    simulate()


if __name__ == "__main__":
    main()
