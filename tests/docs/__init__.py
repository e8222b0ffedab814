"""Every command and snippet in README.md and docs/ runs as written (``snippets`` reads
the pages), and the site builds; snippets that load BPF are marked ``kernel``."""
