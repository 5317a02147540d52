"""A bf16 GGUF of a quantized one, for llama.cpp to run at the precision our engine runs.

Our engine's weights are the shipped GGUF de-quantized (`workers.engine.models.convert_gguf`)
and stored in bf16. This writes the same values back into a GGUF llama.cpp reads: every
matrix de-quantized and rounded to bf16, the 1-D tensors (norms) in f32 as llama.cpp's
own converter keeps them, and every metadata field (architecture, tokenizer, chat
template) as it was, but `general.file_type`, which names the new precision.
"""

from pathlib import Path

BF16_FILE_TYPE = 32  # llama.cpp's LLAMA_FTYPE_MOSTLY_BF16


def bf16_gguf_path(source: Path, cache_dir: Path) -> Path:
    return cache_dir / f"{source.stem}.bf16.gguf"


def write_bf16_gguf(source: Path, out_path: Path) -> Path:
    """`source` re-written with bf16 matrices at `out_path` (kept when already there, written atomically)."""
    import gguf
    import numpy

    if out_path.is_file():
        return out_path
    reader = gguf.GGUFReader(source)
    architecture = reader.fields["general.architecture"].contents()
    partial = out_path.with_name(out_path.name + ".partial")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(partial, architecture)  # writes general.architecture itself
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # the header's own fields
        if field.name == "general.file_type":
            writer.add_file_type(BF16_FILE_TYPE)
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(numpy.float32)  # [rows, cols] or [n]
        if values.ndim == 1:
            writer.add_tensor(tensor.name, values)
        else:
            writer.add_tensor(tensor.name, gguf.quants.quantize(values, gguf.GGMLQuantizationType.BF16),
                              raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(out_path)
    return out_path
