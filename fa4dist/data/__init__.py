"""Training data for the recipes: byte-level tokens (or a local Hugging Face tokenizer's) of local text, packed
into windows of documents, and cut into context-parallel shards by the LPT plan.

```python
from fa4dist.data import PackedTokenStream, collect_documents, make_sample_plan, shard_sample

docs = collect_documents()                      # this repository's source and docs
stream = PackedTokenStream(docs, seqlen=4096)   # windows with cu_seqlens / positions / labels
sample = stream.window(0)
plan = make_sample_plan(sample, 2)              # over 2 cp ranks: fa4dist.context_parallel.make_plan (LPT)
local = shard_sample(sample, plan, rank=1)      # tokens, labels, positions of cp rank 1
```
"""

from .packing import (
    DEFAULT_SUFFIXES,
    IGNORE,
    PackedTokenStream,
    Sample,
    collect_documents,
    default_text_root,
    positions_from_cu_seqlens,
    segments_from_doc_ids,
)
from .sharding import LocalBatch, SingleRankPlan, make_sample_plan, shard_sample
from .tokenizer import BOS, EOS, PAD, VOCAB_SIZE, ByteTokenizer, PretrainedTokenizer

__all__ = [
    "BOS", "EOS", "PAD", "VOCAB_SIZE", "ByteTokenizer", "PretrainedTokenizer", "IGNORE", "DEFAULT_SUFFIXES",
    "PackedTokenStream", "Sample",
    "collect_documents", "default_text_root", "positions_from_cu_seqlens", "segments_from_doc_ids",
    "LocalBatch", "SingleRankPlan", "make_sample_plan", "shard_sample",
]
