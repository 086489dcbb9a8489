"""The real executor: model definitions, GGUF and safetensors loading, tokenizers,
paged KV tensors per tier, attention and the native kernels (csrc/, compiled at first
use), sampling and constrained decoding. The one layer below the server that imports
torch; it implements `engine`'s Executor interface."""
