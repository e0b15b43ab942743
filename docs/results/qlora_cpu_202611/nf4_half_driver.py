import importlib.util, json, sys, time
sys.path.insert(0, "scripts")
spec = importlib.util.spec_from_file_location("bench_convergence", "scripts/bench_convergence.py")
bc = importlib.util.module_from_spec(spec); sys.modules["bench_convergence"] = bc; spec.loader.exec_module(bc)
import torch
sys.argv = ["bench_convergence.py", "--model", "smollm2", "--device", "cpu", "--dtype", "float32", "--backend", "torch",
            "--base-precision", "nf4", "--reference-dtype", "none", "--steps", "8", "--global-batch", "2", "--adapters", "3",
            "--eval-samples", "8", "--samples-file", "docs/results/fp8_cpu_202611/smollm2_aclsum80_samples.jsonl.gz",
            "--lr", "2e-3", "--dropout", "0.0", "--capacity", "1024", "--pad-multiple", "16"]
import argparse
ap_args = None
# parse with the script's own parser
orig = bc.main
def parse():
    import argparse as ap_mod
    captured = {}
    real = ap_mod.ArgumentParser.parse_args
    def grab(self, *a, **k):
        captured["args"] = real(self, *a, **k)
        raise SystemExit(0)
    ap_mod.ArgumentParser.parse_args = grab
    try:
        orig()
    except SystemExit:
        pass
    ap_mod.ArgumentParser.parse_args = real
    return captured["args"]
args = parse()
t0 = time.perf_counter()
case = bc.build_case(args, "smollm2", torch.device("cpu"), torch.float32)
params, options = bc.quantized_base(args, case)
print(f"built in {time.perf_counter() - t0:.1f}s, {len(case.microbatches)} microbatches", flush=True)
r = bc.train(case, label="ours_nf4", backend="torch", params=params, adapter_dtype=torch.float32, options=options)
print(f"ours_nf4: {r.seconds:.1f}s, losses {r.losses}, eval {r.eval_losses}", flush=True)
json.dump({"args": vars(args), "label": r.label, "seconds": r.seconds, "losses": r.losses, "eval_losses": r.eval_losses,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
          open("docs/results/qlora_cpu_202611/convergence_smollm2_nf4_run.json", "w"), indent=1)
