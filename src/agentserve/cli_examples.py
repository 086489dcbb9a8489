"""An example or two at the end of every command's `--help`, checked by the
tests to parse (tests/test_cli_examples.py), so they cannot go stale."""

from __future__ import annotations

import argparse

EXAMPLES: dict[str, list[str]] = {
    "": ["agentserve serve",
         "agentserve serve --help"],
    "sim": ["agentserve sim --workload swebench --policies agentserve,vllm-fcfs --rates 0.2,0.5 --programs 100",
            "agentserve sim --workload bfcl --host-tier --replicas 4 --router program --json sim.json",
            "agentserve sim --profile gemma3-27b-h100 --kv-layout full,hybrid --policies agentserve --rates 0.05,0.1"],
    "serve": ["agentserve serve --port 8001 --kv-cache-tokens 131072 --api-key secret",
              "agentserve serve --model path/to/model.gguf --served-model-name my-model --host 0.0.0.0",
              "agentserve serve --model gemma3-270m",
              "agentserve serve --state-dir agentserve-state --state-save-interval 30"],
    "cluster": ["agentserve cluster --replicas 2 --router program --port 8000"],
    "bench": ["agentserve bench run --url http://127.0.0.1:8000 --workload swebench --programs 16 --rate 0.5"],
    "bench run": ["agentserve bench run --url http://127.0.0.1:8000 --workload swebench --programs 16 --rate 0.5 "
                  "--token-scale 1.0 --json run.json --report run.md",
                  "agentserve bench run --url http://127.0.0.1:8000 --api messages --programs 6 --rate 0.3",
                  "agentserve bench run --url http://127.0.0.1:8000 --workload claude-code --programs 6 --rate 0.05 "
                  "--token-scale 1.0 --max-output-tokens 1024 --report claude-code.md"],
    "bench report": ["agentserve bench report agentserve.json vllm.json --report compare.md --plot compare"],
    "bench compare": ["agentserve bench compare --servers agentserve-agentserve,vllm-cpu --workload swebench "
                      "--programs 12 --rate 0.3 --token-scale 1.0 --kv-tokens 16384 --json compare.json",
                      "agentserve bench compare --model gemma3-270m --servers agentserve-agentserve,llama-server "
                      "--token-scale 1.0 --kv-tokens 32768 --llama-server-slots 8 --json gemma.json"],
    "generate": ['agentserve generate "def fib(n):" --max-tokens 64 --stop "\\n\\n"',
                 'agentserve generate --chat "Write a haiku about caches." --model path/to/model.gguf'],
    "models": ["agentserve models"],
    "profile": ["agentserve profile",
                "agentserve profile --model path/to/model.gguf --contexts 512,4096 --output profile.json"],
}


class _ExamplesLast(argparse.HelpFormatter):
    """Keeps the examples' lines as written; everything else is wrapped as usual."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("examples:\n"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, parser) for the parser and every subcommand below it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, path + (name,))


def add_examples(parser: argparse.ArgumentParser) -> None:
    """Every command's examples as its help's epilog."""
    for path, p in commands(parser):
        lines = EXAMPLES.get(" ".join(path))
        if not lines:
            continue
        p.epilog = "examples:\n" + "\n".join("  " + line for line in lines)
        p.formatter_class = type("ExamplesFormatter", (_ExamplesLast, p.formatter_class), {})
