"""Old (auto-vectorized, before this branch) against new (explicit AVX-512) CPU quant kernels, one process, one thread, interleaved."""
import importlib.util, sys, time, torch
torch.set_num_threads(1)


def load(path):
    spec = importlib.util.spec_from_file_location("moecomm_ext_quant_cpu", path)
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m


old = load(sys.argv[1]); new = load(sys.argv[2])
rng = torch.Generator().manual_seed(0)
print(f"# torch {torch.__version__}, 1 thread, medians of 101 interleaved calls; rows of 1024 elements")
for dtype in (torch.float32, torch.bfloat16):
    for rows in (256, 1024):
        x = torch.randn(rows, 1024, generator=rng).to(dtype)
        rb = 1024 + 32 + 0  # packed_row_bytes(1024) = 1056
        rb = -(-(1024 + 4 * 8) // 16) * 16
        assert torch.equal(old.quantize_pack(x, 0, 128, rb), new.quantize_pack(x, 0, 128, rb))
        p = new.quantize_pack(x, 0, 128, rb); out = torch.empty_like(x)
        assert torch.equal(old.unpack_dequantize(p, 1024, 0, 128, dtype, None), new.unpack_dequantize(p, 1024, 0, 128, dtype, None))
        res = {k: [] for k in ("pack_old", "pack_new", "unpack_old", "unpack_new")}
        for _ in range(101):
            for k, f in (("pack_old", lambda: old.quantize_pack(x, 0, 128, rb)), ("pack_new", lambda: new.quantize_pack(x, 0, 128, rb)),
                         ("unpack_old", lambda: old.unpack_dequantize(p, 1024, 0, 128, dtype, out)),
                         ("unpack_new", lambda: new.unpack_dequantize(p, 1024, 0, 128, dtype, out))):
                t = time.perf_counter(); f(); res[k].append(time.perf_counter() - t)
        med = {k: sorted(v)[50] * 1e6 for k, v in res.items()}
        print(f"{str(dtype)[6:]:9} {rows:5} rows ({x.numel() * x.element_size() >> 10} KiB): pack {med['pack_old']:.0f} -> {med['pack_new']:.0f} us "
              f"({med['pack_old'] / med['pack_new']:.2f}x), unpack {med['unpack_old']:.0f} -> {med['unpack_new']:.0f} us "
              f"({med['unpack_old'] / med['unpack_new']:.2f}x); same bytes")
