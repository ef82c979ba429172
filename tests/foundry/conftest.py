"""The training tests' shards (tools/shard.py on the synthetic corpus), for the llm-foundry plugin's tests."""

from tests.training.conftest import corpus_dir, dolma_shards, math_shards  # noqa: F401  (session fixtures)
