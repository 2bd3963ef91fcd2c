"""A third-party drafter written only against the Drafter protocol is admitted, priced and drafts exactly."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from tensorfold_core import hookimpl
from tensorfold_core.cli import _options
from tensorfold_core.loading import DRAFTER_MEMBERS, resolve_model
from tensorfold_core.plugins import plugin_manager
from tensorfold_core.protocols import Drafter
from tensorfold_core.specs import DrafterOptions, ServeOption

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")

# the target drafts for itself through the Model protocol's public forward: greedy drafts the target then keeps
PLUGIN = textwrap.dedent('''
    """A throwaway drafter plugin: the target's own greedy chain, through tensorfold's public protocols only."""
    import mlx.core as mx

    from tensorfold_core import hookimpl
    from tensorfold_core.errors import DrafterError
    from tensorfold_core.protocols import DEPTH_RULE
    from tensorfold_core.specs import DrafterKind, ServeOption


    def matches(ckpt):
        return ckpt.config.get("model_type") == "toy_self_drafter"


    def admit(target, ckpt, bits):
        if bits not in (None, 0):
            raise DrafterError(f"--drafter-bits {bits}: the toy self-drafter holds no weights")


    class SelfDrafter:
        name = "toy-self"
        facts = DEPTH_RULE

        def __init__(self, target, options):
            self.target, self.options, self.proposals = target, options, 0

        def catch_up(self, asks):
            return 0

        def propose(self, asks):
            self.proposals += 1
            out = []
            for ask in asks:
                tokens = list(ask.tokens)
                cache = self.target.new_cache(ask.limit + self.options.max_depth)
                ids = mx.array(tokens, dtype=mx.uint32)
                logits = self.target.forward_ids([cache], ids, [len(tokens)], [1], commit=True)
                chain = []
                for _ in range(ask.depth):
                    token = mx.argmax(logits, axis=-1)
                    chain.append(token)
                    logits = self.target.forward_ids([cache], token, [1], [1], commit=True)
                mx.eval(chain)
                drafts = [int(t.item()) for t in chain]
                stop = next((i + 1 for i, t in enumerate(drafts) if t in self.options.eos_ids), len(drafts))
                out.append(drafts[:stop])
            return out

        def release(self, stream_id):
            pass

        def slot_bytes_for(self, tokens):
            return self.target.cache_bytes(tokens + self.options.max_depth)

        def kept_bytes(self):
            return 0

        def shed_kept(self, wanted_bytes=None):
            return 0

        def close(self):
            pass


    def start(target, ckpt, options):
        if options.plugin_options.get("toy-self-depth") is not None:
            options = options.replace(max_depth=int(options.plugin_options["toy-self-depth"]))
        return SelfDrafter(target, options)


    @hookimpl
    def tensorfold_serve_options():
        return [ServeOption(name="toy-self-depth", help="Deepest chain the toy self-drafter drafts.", default=None,
                            type=int)]


    @hookimpl
    def tensorfold_drafters():
        return [DrafterKind(name="toy-self", matches=matches, admit=admit, start=start)]
''')


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The plugin installed through a dist-info on a path entry, and a drafter checkpoint dir it reads."""
    site = tmp_path_factory.mktemp("site")
    (site / "toy_drafter.py").write_text(PLUGIN)
    info = site / "toy_drafter-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-drafter\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[tensorfold]\ntoy_drafter = toy_drafter\n")
    ckpt = site / "self-drafter"
    ckpt.mkdir()
    target = resolve_model("tiny-llama")
    eos = json.loads((target / "config.json").read_text())["eos_token_id"]
    (ckpt / "config.json").write_text(json.dumps({"model_type": "toy_self_drafter", "eos_token_id": eos}))
    for name in TOKENIZER_FILES:
        shutil.copy(target / name, ckpt / name)
    return site, ckpt


def tensorfold(site, *args, check=True):
    env = dict(os.environ, PYTHONPATH=str(site))
    return subprocess.run([sys.executable, "-m", "tensorfold_core", *args], env=env, capture_output=True,
                          text=True, timeout=300, check=check)


def test_a_third_party_drafter_drafts_through_the_protocol_and_the_reply_equals_the_plain_one(installed):
    site, ckpt = installed
    assert "drafters [toy-self]" in tensorfold(site, "families").stdout
    result = tensorfold(site, "run", "tiny-llama", "import os\nimport", "--max-tokens", "24", "--json",
                        "--draft", f"{ckpt},4")
    report = json.loads(result.stdout)
    assert report["equal_to_plain"] is True and report["token_ids"] == report["plain_token_ids"]
    assert sum(r["kept"] for r in report["rounds"]) > 0 and len(report["rounds"]) < report["plain_rounds"]


def test_a_third_party_drafter_gets_the_cores_tokenizer_check_and_is_refused_served_alone(installed, tmp_path):
    site, ckpt = installed
    alone = tensorfold(site, "run", str(ckpt), "x", check=False)
    assert alone.returncode == 2 and "self-drafter is admitted only as a drafter" in alone.stderr
    other = shutil.copytree(ckpt, tmp_path / "other-tokenizer")
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": "<|pad|>"}))
    refused = tensorfold(site, "run", "tiny-llama", "x", "--draft", f"{other},2", check=False)
    assert refused.returncode == 2
    assert "drafter other-tokenizer does not share the target's tokenizer: bos ids differ" in refused.stderr


def test_the_drafter_protocol_names_every_member_core_checks_at_start():
    declared = {name for name in dir(Drafter) if not name.startswith("_")}
    declared |= {name for cls in Drafter.__mro__ for name in getattr(cls, "__annotations__", {})}
    assert set(DRAFTER_MEMBERS) <= declared


def test_a_plugins_serve_flag_is_listed_by_serve_help_and_capabilities(installed):
    site, _ = installed
    shown = " ".join(tensorfold(site, "serve", "--help").stdout.split()).replace("- ", "-")  # unwrapped
    assert "--toy-self-depth" in shown and "(toy_drafter) Deepest chain the toy self-drafter drafts." in shown
    flags = json.loads(tensorfold(site, "capabilities", "--json").stdout)["serve_flags"]
    assert flags["toy-self-depth"] == {"default": None, "plugin": "toy_drafter",
                                       "description": "Deepest chain the toy self-drafter drafts."}
    assert "max_depth" not in flags and "drafter_bits" in flags


class DepthFlag:
    @hookimpl
    def tensorfold_serve_options(self):
        return [ServeOption(name="toy-depth", help="a depth", type=int)]


def test_a_plugins_serve_flag_value_reaches_its_drafters_options():
    plugin = DepthFlag()
    plugin_manager().register(plugin, name="toy-depth-flag")
    try:
        options = _options(parallel="3", plugin__toy_depth=5)
    finally:
        plugin_manager().unregister(plugin)
    assert options.parallel == 3 and options.plugin_options == {"toy-depth": 5}
    assert DrafterOptions.serving(options).plugin_options == {"toy-depth": 5}
