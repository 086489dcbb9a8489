"""MkDocs hooks: the pages that must not drift from the code are generated at
build time. `<!-- generated: cli -->` becomes every command's `--help`, from
the argparse parsers `agentserve` itself uses; `<!-- generated: http-api -->`
becomes the operations of the OpenAPI document the server serves at
/openapi.json."""

from __future__ import annotations

import argparse
import os
import re

_MARKER = re.compile(r"<!-- generated: ([\w-]+) -->")


def on_page_markdown(markdown: str, page, config, files) -> str:
    return _MARKER.sub(lambda m: _GENERATORS[m.group(1)](), markdown)


def _commands(parser: argparse.ArgumentParser, path: list[str]):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, path + [name])


def _cli() -> str:
    from agentserve.cli import build_parser

    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal; the page must not depend on it
    out = []
    for path, parser in _commands(build_parser(), ["agentserve"]):
        depth = min(len(path) + 1, 4)
        out.append(f"{'#' * depth} `{' '.join(path)}`\n\n```text\n{parser.format_help().rstrip()}\n```\n")
    return "\n".join(out)


def _http_api() -> str:
    from agentserve.server.openapi import openapi_document

    doc = openapi_document(["<served model name>"], auth=True)
    out = ["| method | path | what it does | answers |", "|---|---|---|---|"]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            if not isinstance(op, dict) or "responses" not in op:
                continue
            codes = ", ".join(sorted(op["responses"]))
            summary = str(op.get("summary", "")).replace("|", "\\|")
            out.append(f"| {method.upper()} | `{path}` | {summary} | {codes} |")
    return "\n".join(out)


_GENERATORS = {"cli": _cli, "http-api": _http_api}
