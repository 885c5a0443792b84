"""Streaming tokenization (data.kind stream): train straight from local parquet / arrow / jsonl
files, tokenized while training, with no `zerotrain prepare` step.

The windows, their order and a resume are the same for any world size, accumulation and number
of tokenizer workers. The price is that every rank reads and tokenizes the whole stream: at scale
`zerotrain prepare` tokenizes once instead.

readers.py  the files, their chunks and the pass order; a chunk's documents and their tokens
pool.py     the tokenizer worker processes and what keeps them safe after fork
dataset.py  the windows (a Dataset), the sampler's shuffle, the resume cursor, the data bundle
"""

from zerotrain.train.data.stream.dataset import StreamSampler, StreamWindows, build_stream
from zerotrain.train.data.stream.readers import StreamCorpus, StreamFile

__all__ = ["StreamCorpus", "StreamFile", "StreamSampler", "StreamWindows", "build_stream"]
