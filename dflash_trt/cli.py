"""The `dflash-trt` command line: a thin click layer over the library.

Commands are loaded lazily (click's documented LazyGroup pattern) so that `--help` and light
commands do not pay for importing torch, transformers or modelopt.
"""
from __future__ import annotations

import importlib
import json
import sys

import click

from dflash_trt import __version__
from dflash_trt.errors import DFlashError

# command name -> "module:attribute" of a click.Command. One entry per user intent.
COMMANDS: dict[str, str] = {
    "make-tiny": "dflash_trt.commands.core:make_tiny_cmd",
    "check": "dflash_trt.commands.core:check_cmd",
    "generate": "dflash_trt.commands.core:generate_cmd",
    "train-drafter": "dflash_trt.commands.train:train_drafter_cmd",
    "corpus": "dflash_trt.commands.train:corpus_cmd",
    "deploy-train": "dflash_trt.commands.train:deploy_train_cmd",
    "draft-vocab": "dflash_trt.commands.vocab:draft_vocab_cmd",
    "bench": "dflash_trt.commands.bench:bench_cmd",
    "quantize": "dflash_trt.commands.quant:quantize_cmd",
    "convert": "dflash_trt.commands.quant:convert_cmd",
    "build": "dflash_trt.commands.build:build_cmd",
    "compile": "dflash_trt.commands.build:compile_cmd",
    "presets": "dflash_trt.commands.build:presets_cmd",
    "verify": "dflash_trt.commands.build:verify_cmd",
    "doctor": "dflash_trt.commands.doctor:doctor_cmd",
    "serve": "dflash_trt.commands.serve:serve_cmd",
    "plugin": "dflash_trt.commands.plugin:plugin_group",
    "export-onnx": "dflash_trt.commands.plugin:export_onnx_cmd",
    "plan": "dflash_trt.commands.deploy:plan_cmd",
    "deploy": "dflash_trt.commands.deploy:deploy_cmd",
    "push": "dflash_trt.commands.deploy:push_cmd",
    "tune": "dflash_trt.commands.tune:tune_cmd",
    "adapt": "dflash_trt.commands.adapt:adapt_cmd",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="dflash-trt")
def cli():
    """Take a target LLM and its DFlash drafter to production on NVIDIA GPUs.

    \b
    Typical flow:
      dflash-trt check    --target DIR --drafter DIR      # is the pair consistent?
      dflash-trt generate --target DIR --drafter DIR -p "Hello"   # lossless speculative decoding
      dflash-trt bench    ...                             # tau and speed-up against plain decoding
      dflash-trt build    --target gpt-oss-120b --arch blackwell   # the deployable bundle

    Every command takes --help; most take --json for machine-readable output.
    """


class _Watched:
    """stdout, noting whether anything was written (a command that printed its JSON report, e.g. a
    failed `check --json`, has said it all: no second JSON document after it)."""

    def __init__(self, stream):
        self.stream, self.wrote = stream, False

    def write(self, text):
        self.wrote = self.wrote or bool(text)
        return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def _error(msg: str, code: int, argv) -> None:
    """The one `error: ...` line on stderr; with --json also {"error", "exit_code"} on stdout, so a
    script reading stdout gets JSON whether the command succeeded or not."""
    out = sys.stdout
    if "--json" in (sys.argv[1:] if argv is None else argv) and not (isinstance(out, _Watched) and out.wrote):
        click.echo(json.dumps({"error": msg, "exit_code": code}))
    click.echo(f"error: {msg}", err=True)


def main(argv=None):
    watched = sys.stdout = _Watched(sys.stdout)
    try:
        _main(argv)
    finally:
        if sys.stdout is watched:
            sys.stdout = watched.stream


def _main(argv=None):
    try:
        cli.main(args=argv, prog_name="dflash-trt", standalone_mode=False)
    except DFlashError as e:
        _error(str(e), 1, argv)
        sys.exit(1)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        # click's own layout (usage, hint), but the last line is `error: ...` like every other failure
        ctx = getattr(e, "ctx", None)
        if ctx is not None:
            click.echo(ctx.get_usage(), err=True)
            click.echo(f"Try '{ctx.command_path} {ctx.help_option_names[0]}' for help.\n", err=True)
        _error(e.format_message(), e.exit_code, argv)
        sys.exit(e.exit_code)
    except OSError as e:
        # an I/O failure no command anticipated: still one line naming the path, never a traceback
        where = f"{e.filename}: " if e.filename else ""
        _error(f"{where}{e.strerror or e}", 1, argv)
        sys.exit(1)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    sys.exit(0)


if __name__ == "__main__":
    main()
