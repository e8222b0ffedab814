"""Recordings: a stream written to Parquet files, read back, and played back through
the same stream API (docs/recording.md). pyarrow is imported on demand."""
