"""Arrow: a decoder's C layout as an Arrow schema, NumPy columns and raw samples as
``pyarrow.RecordBatch``es, and a builder that turns events into batches with bounded
memory. pyarrow (``aperf-bpf[arrow]``) is imported on demand, never by ``import aperf``."""
