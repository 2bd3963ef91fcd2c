"""The `tensorfold` command: serve, run, capabilities, families."""

from __future__ import annotations

import json
import os
import sys
import time
import typing

import click
import pydantic

from .errors import TensorfoldError
from .options import ServeOptions


class Cli(click.Group):
    """Usage and product errors end in one line on stderr and exit status 2."""

    def main(self, *args, **kwargs):
        kwargs["standalone_mode"] = False
        try:
            return super().main(*args, **kwargs)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("tensorfold: aborted", err=True)
            sys.exit(1)
        except click.UsageError as exc:
            where = f"{exc.ctx.command_path}: " if exc.ctx else "tensorfold: "
            click.echo(f"{where}error: {exc.format_message()}", err=True)
            sys.exit(2)
        except TensorfoldError as exc:
            click.echo(f"tensorfold: error: {exc}", err=True)
            sys.exit(2)


def _click_type(annotation):
    """The click type for a ServeOptions field: choices for Literals, the base type for Optionals."""
    args = [annotation] if typing.get_origin(annotation) is typing.Literal else \
        [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    if typing.get_origin(args[0]) is typing.Literal:
        return click.Choice([str(v) for v in typing.get_args(args[0])])
    return {int: int, str: str, float: float}.get(args[0], str)


def serve_options(func):
    """Click options generated from the one ServeOptions table, then the installed plugins' own flags."""
    for option, plugin in reversed(_plugin_flags()):
        kind = click.Choice([str(c) for c in option.choices]) if option.choices else option.type
        func = click.option(f"--{option.name}", _plugin_param(option.name), type=kind, default=option.default,
                            show_default=option.default is not None, help=f"({plugin}) {option.help}")(func)
    for name, field in reversed(list(ServeOptions.flag_fields().items())):
        func = click.option(ServeOptions.flag(name), name, type=_click_type(field.annotation),
                            default=None if field.default is None else str(field.default),
                            show_default=field.default is not None, help=field.description)(func)
    return func


PLUGIN_PARAM = "plugin__"  # click parameter names of plugin flags, kept apart from ServeOptions' fields


def _plugin_param(flag: str) -> str:
    return PLUGIN_PARAM + flag.replace("-", "_")


def _plugin_flags() -> list:
    """The installed plugins' serve flags with their plugins (none where the registry cannot be read: --help
    still works, and the command that needs the registry reports it)."""
    from .plugins import registry

    try:
        return registry().serve_options_by_plugin()
    except Exception:  # a broken plugin must not take `--help` down with it
        return []


def _options(**values) -> ServeOptions:
    plugin = {option.name: values.pop(_plugin_param(option.name)) for option, _ in _plugin_flags()
              if _plugin_param(option.name) in values}
    given = {k: v for k, v in values.items() if v is not None}
    try:
        return ServeOptions(**_coerce(given), plugin_options=plugin)
    except pydantic.ValidationError as exc:  # name the flag, not the field
        first = exc.errors()[0]
        raise click.UsageError(f"{ServeOptions.flag(str(first['loc'][0]))}: {first['msg']}")


def _coerce(values: dict) -> dict:
    """Choices arrive as strings; Literal ints want ints."""
    out = {}
    for name, value in values.items():
        annotation = ServeOptions.model_fields[name].annotation
        args = (annotation,) if typing.get_origin(annotation) is typing.Literal else typing.get_args(annotation)
        literal = next((a for a in args if typing.get_origin(a) is typing.Literal), None)
        if literal is not None and all(isinstance(v, int) for v in typing.get_args(literal)):
            value = int(value)
        out[name] = value
    return out


LOAD_STAGES = ("resolving", "loading weights", "probing row invariance", "starting drafter", "warming up", "ready")


def _progress():
    """A progress bar over the loading stages on a terminal; silent otherwise."""
    if not sys.stderr.isatty():
        return lambda stage: None
    start, width = time.monotonic(), 24

    def show(stage: str) -> None:
        known = next((i for i, s in enumerate(LOAD_STAGES) if stage.startswith(s)), len(LOAD_STAGES) - 2)
        filled = width * (known + 1) // len(LOAD_STAGES)
        click.echo(f"\r[{'#' * filled}{'.' * (width - filled)}] {time.monotonic() - start:5.1f}s {stage:<40}",
                   err=True, nl=stage == "ready")

    return show


@click.group(cls=Cli)
@click.version_option(package_name="tensorfold")
def main():
    """tensorfold: exact speculative decoding on MLX, served OpenAI-style."""


@main.command()
@click.argument("model", required=False)
@serve_options
def serve(model, **values):
    """Serve MODEL (a dir, a shipped name or a hub id; default: the shipped default model)."""
    from .group import join
    from .loading import follow_group, load_host
    from .server import serve as run_server

    options = _options(**values)
    joined = join()  # launched by `mlx.launch`: a group whose rank 0 serves and the others follow
    if joined is not None and joined.rank > 0:
        code = follow_group(model, options, joined)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    progress = _progress()
    host = load_host(model, options, progress=progress, joined=joined)
    progress("ready")
    try:
        run_server(host, options.host, options.port, options=options)
    finally:
        host.close()


@main.command()
@click.argument("model")
@click.argument("prompt")
@click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(min=1),
              help="Most tokens to generate.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with text, token_ids and rounds.")
@click.option("--chat", is_flag=True, help="Wrap PROMPT in the model's chat template as a user message.")
@click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float16", "float32"]), default="auto",
              show_default=True, help="Float dtype of the weights and activations.")
@click.option("--draft", metavar="DRAFTER,N", help="Also decode through DRAFTER's windows of N drafts and "
              "state whether the tokens equal the plain greedy ones.")
def run(model, prompt, max_tokens, as_json, chat, dtype, draft):
    """Greedy check mode: decode PROMPT with MODEL and print the text (or JSON with per-round stats)."""
    from .checkmode import check_run

    result = check_run(model, prompt, max_tokens=max_tokens, chat=chat, dtype=dtype, draft=draft,
                       progress=_progress())
    if as_json:
        click.echo(json.dumps(result))
        return
    click.echo(result["text"])
    if draft:
        kept = sum(r["kept"] for r in result["rounds"])
        offered = sum(r["drafted"] for r in result["rounds"])
        verdict = "EQUAL to" if result["equal_to_plain"] else "DIFFERENT from"
        click.echo(f"{len(result['token_ids'])} tokens in {len(result['rounds'])} rounds "
                   f"(plain: {result['plain_rounds']}); drafts kept {kept} of {offered}; "
                   f"tokens {verdict} the plain greedy tokens", err=True)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def capabilities(as_json):
    """What this install can do: version, backend, device, families, drafters, serve flags."""
    from .backend import backend_row_invariance
    from .capabilities import capabilities as caps
    from .group import describe_launch
    from .memory.ledger import default_budget

    info = caps(ServeOptions(), extra={"row_invariance": backend_row_invariance(),
                                       "memory": {"default_budget_bytes": default_budget()},
                                       "group": describe_launch()})
    if as_json:
        click.echo(json.dumps(info, indent=2, default=str))
        return
    click.echo(f"tensorfold {info['version']} on {info['device']} (mlx {info['mlx']})")
    click.echo(f"row invariance: {info['row_invariance']}")
    click.echo("families: " + ", ".join(f["name"] for f in info["families"]))


@main.command()
def families():
    """Every installed plugin with its distribution, version, families, drafters and kernel count."""
    from .plugins import registry

    rows = registry().roll_call()
    if not rows:
        click.echo("no plugins installed (pip install tensorfold-llama)")
    for row in rows:
        click.echo(f"{row['distribution'] or row['plugin']} {row['version'] or ''}: "
                   f"families [{', '.join(row['families'])}], drafters [{', '.join(row['drafters'])}], "
                   f"kernels {row['kernels']}, models [{', '.join(row['models'])}]")


@main.command()
@click.option("--only", multiple=True, metavar="NAME",
              help="A kernel, family, plugin or distribution name (globs allowed); repeatable.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--seed", type=int, default=None, help="Draw the inputs from this seed (default: fresh each run).")
def contract(only, as_json, seed):
    """Prove every installed kernel: gates 1-5 on each implementation this device runs, and planted controls."""
    from tensorfold_contract.cli import run_cli

    sys.exit(run_cli(only, as_json, seed))
