"""Models on disk: `.base` files, the converters that make them, the hub client and the local store.

- `.base` files: `base_format.py` (layout and size rules), `base_writer.py`, `base_reader.py`
  (validated by `base_header.py`), `base_inspect.py` (`base inspect`).
- Pulling: `pull.py` (from the hub, via `hub.py`), `import_local.py` (a local path),
  `variants.py` (what a tag or options ask for), `registry.py` (the store itself).
- Converting: `convert.py` picks `convert_hf.py`, `convert_gguf.py` or `convert_mlx.py`, which
  read their sources (`hf.py`, `gguf.py` + `gguf_quants.py`, `mlx_folder.py`) as a
  `SourceModel` (`source_model.py`); `quantize.py` holds the schemes and profiles.
- `fs.py`: crash-safe writes; `errors.py`: the store's errors; `default_model.py`: SmolLM2's GGUF.
"""
