"""``_compat.relative_interpolations``: the rewrite that lets jsonargparse 4.41 (the newest litgpt 0.5.13
admits) read a config's ``${trainer.x}`` from the file's own root, as 4.42's
``omegaconf_absolute_to_relative_paths`` does. The command itself runs under whichever jsonargparse is
installed in test_cli.py (``test_interpolation_follows_command_line_overrides``); the lowest-floors row of
``.ci/test-matrix`` runs it on 4.41, where the rewrite is the loader."""

from __future__ import annotations

import inspect

import jsonargparse
import pytest
from omegaconf import OmegaConf

from lightning_zero import _compat

CONFIG = {
    "trainer": {
        "default_root_dir": "runs/a",
        "callbacks": [{"init_args": {"dirpath": "${trainer.default_root_dir}/checkpoints"}}],
    },
    "model": {"init_args": {"context": 16, "width": "${model.init_args.context}", "bucket": "${oc.env:BUCKET,b}",
                            "sibling": "${.context}"}},
    "data": {"init_args": {"context": 16, "name": "plain text, no interpolation"}},
}


def test_absolute_references_climb_to_the_documents_root() -> None:
    rewritten = _compat.relative_interpolations(CONFIG)
    # dirpath is five keys below the root (trainer, callbacks, 0, init_args, dirpath): five dots.
    assert rewritten["trainer"]["callbacks"][0]["init_args"]["dirpath"] == "${.....trainer.default_root_dir}/checkpoints"
    assert rewritten["model"]["init_args"]["width"] == "${...model.init_args.context}"
    assert rewritten["model"]["init_args"]["bucket"] == "${oc.env:BUCKET,b}"  # a resolver: untouched
    assert rewritten["model"]["init_args"]["sibling"] == "${.context}"  # already relative: untouched
    assert rewritten["data"] == CONFIG["data"] and rewritten["model"]["init_args"]["context"] == 16


@pytest.mark.parametrize("mount", [(), ("fit",), ("fit", "deeper")])
def test_the_rewritten_file_resolves_the_same_wherever_it_is_mounted(mount: tuple[str, ...]) -> None:
    document: dict = _compat.relative_interpolations(CONFIG)
    for key in reversed(mount):
        document = {key: document, "trainer": {"default_root_dir": "the wrong root"}}
    resolved = OmegaConf.to_container(OmegaConf.create(document), resolve=True)
    for key in mount:
        resolved = resolved[key]
    assert resolved["trainer"]["callbacks"][0]["init_args"]["dirpath"] == "runs/a/checkpoints"
    assert resolved["model"]["init_args"]["width"] == 16 and resolved["model"]["init_args"]["sibling"] == 16


def test_the_installed_jsonargparse_gets_the_setting_or_the_loader() -> None:
    has_setting = "omegaconf_absolute_to_relative_paths" in inspect.signature(
        jsonargparse.set_parsing_settings).parameters
    assert has_setting == (_compat._release(jsonargparse.__version__) >= (4, 42))
    assert _compat._release(jsonargparse.__version__) >= _compat._release(_compat.MIN_JSONARGPARSE)
