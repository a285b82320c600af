#!/bin/bash
# Nsight Compute profile of one call each of the prefill / draft_roll kernels and
# their peers (GPU machine). Usage:
#   bash mtpjax/bench/ncu_profile.sh OUTDIR [TARGETS]
# TARGETS: see mtpjax.bench.kernel_sweep.ncu_target (default below). Writes OUTDIR/prof.ncu-rep,
# details.txt (all sections, every kernel of the profiled calls), raw.csv (selected
# counters), sass_*.csv (per-instruction SASS of our kernels), env.txt.
#   NCU_MODE=times bash mtpjax/bench/ncu_profile.sh OUTDIR TARGETS
# only times every kernel of the targets' calls (one pass each, caches not flushed,
# so back-to-back kernels see each other's L2 state) and prints them grouped by name.
set -u
O=${1:?outdir}
T=${2:-prefill:64,prefill:32,cudnn:64,roll,roll_xla}
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
if [ "${NCU_MODE:-}" = times ]; then
  timeout "${NCU_TIMEOUT:-300}" ncu --clock-control none --cache-control none --profile-from-start off \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum --csv --print-units base \
    --log-file "$O/times.csv" python3 -m mtpjax.bench.kernel_sweep --ncu-target "$T" > "$O/times_run.log" 2>&1
  echo "ncu rc $?" >> "$O/times_run.log"
  python3 - "$O/times.csv" "$O/times_run.log" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
h = rows[0]; ix = {c: i for i, c in enumerate(h)}
targets = [l.split()[2].rstrip(":") for l in open(sys.argv[2]) if l.startswith("ncu target")]
order, cur, last = [], None, None
for r in rows[1:]:
  if not r[ix["ID"]].isdigit(): continue
  name, m, v = r[ix["Kernel Name"]], r[ix["Metric Name"]], r[ix["Metric Value"]].replace(",", "")
  key = (r[ix["ID"]], name)
  if key != last:
    order.append([name, {}]); last = key
  order[-1][1][m] = float(v)
# Targets run in order and each call starts after the previous one's kernels.
print("kernels in profiled calls:", len(order), "targets:", targets)
g = collections.OrderedDict()
for name, mm in order:
  e = g.setdefault(name, [0, 0.0, 0.0, 0.0]); e[0] += 1
  e[1] += mm.get("gpu__time_duration.sum", 0) / 1e3  # ns -> us (--print-units base)
  e[2] += mm.get("dram__bytes_read.sum", 0) / 1e6; e[3] += mm.get("dram__bytes_write.sum", 0) / 1e6
for name, (n, t, rd, wr) in g.items():
  print(f"{name[:40]:40s} n={n:3d} sum_us={t:9.1f} mean_us={t / n:8.2f} dram_rd_MB={rd / n:7.1f} dram_wr_MB={wr / n:7.1f}")
PY
  exit 0
fi
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv; ncu --version; } > "$O/env.txt" 2>&1
Q=$(ncu --query-metrics --chip gh100 2>/dev/null | awk '{print $1}')
grep -iE 'gmma|hmma' <<<"$Q" >> "$O/env.txt"
M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed
for b in sm__pipe_tensor_op_gmma_cycles_active sm__pipe_tensor_op_hmma_cycles_active; do
  grep -qx "$b" <<<"$Q" && M="$M,$b.avg.pct_of_peak_sustained_active"; done
for b in sm__inst_executed_pipe_tensor_op_gmma sm__inst_executed_pipe_tensor_op_hmma \
         sm__ops_path_tensor_src_bf16_dst_fp32; do
  grep -qx "$b" <<<"$Q" && M="$M,$b.sum"; done
S=""
for s in SpeedOfLight MemoryWorkloadAnalysis MemoryWorkloadAnalysis_Tables Occupancy LaunchStats \
         ComputeWorkloadAnalysis WarpStateStats SchedulerStats InstructionStats SourceCounters; do
  S="$S --section $s"; done
echo "ncu --clock-control none --profile-from-start off$S --metrics $M -o prof" >> "$O/env.txt"
timeout "${NCU_TIMEOUT:-300}" ncu --clock-control none --profile-from-start off $S --metrics "$M" \
  -o "${NCU_REP:-$O/prof}" -f python3 -m mtpjax.bench.kernel_sweep --ncu-target "$T" > "$O/ncu_run.log" 2>&1
echo "ncu rc $?" >> "$O/ncu_run.log"
ncu -i "${NCU_REP:-$O/prof}.ncu-rep" > "$O/details.txt" 2>&1
ncu -i "${NCU_REP:-$O/prof}.ncu-rep" --page raw --csv --metrics "$M,launch__registers_per_thread,launch__grid_size,launch__block_size,launch__occupancy_limit_registers,sm__warps_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum,dram__bytes_write.sum" > "$O/raw.csv" 2>&1
i=0
for k in paged_attn_bq8 paged_attn_bq16 draft_roll; do
  ncu -i "${NCU_REP:-$O/prof}.ncu-rep" -k "regex:$k" --launch-count 1 --page source --print-source sass --csv \
    > "$O/sass_$k.csv" 2>&1
done
python3 - "$O" <<'PY'
import csv, collections, re, sys, os
o = sys.argv[1]
for f in sorted(os.listdir(o)):
  if not f.startswith("sass_"):
    continue
  rows = list(csv.reader(open(os.path.join(o, f), errors="replace")))
  hdr = next((r for r in rows if "Source" in r), None)
  if not hdr:
    print(f, "no source table:", " | ".join(",".join(r)[:120] for r in rows[:3])); continue
  si = hdr.index("Source")
  ei = next((i for i, h in enumerate(hdr) if h.startswith("Instructions Executed")), None)
  cnt = collections.Counter(); ex = collections.Counter()
  for r in rows[rows.index(hdr) + 1:]:
    if len(r) <= si: continue
    m = re.match(r"\s*(@!?U?P\w+\s+)?([A-Z0-9_]+)(\.[\w.]+)?", r[si])
    if not m: continue
    op = m.group(2) + (m.group(3) or "")[:12]
    cnt[op.split(".")[0]] += 1
    if ei is not None:
      try: ex[op] += float(r[ei].replace(",", ""))
      except ValueError: pass
  keys = ("HGMMA", "HMMA", "LDGSTS", "LDG", "STG", "LDS", "STS", "LDSM", "STSM", "UTMALDG", "BAR", "WARPGROUP")
  print(f, "static:", {k: cnt[k] for k in keys if cnt[k]})
  print(f, "executed top:", ", ".join(f"{k} {v:.0f}" for k, v in ex.most_common(14)))
# One line per kernel of >= 3 us: the counters behind docs/benchmarks.md.
keys = {"Duration": "us", "DRAM Throughput": "dram%", "Compute (SM) Throughput": "sm%",
        "Memory Throughput": "mem%", "L2 Cache Throughput": "l2%", "L1/TEX Cache Throughput": "l1%",
        "Registers Per Thread": "regs", "Achieved Occupancy": "occ%", "Theoretical Occupancy": "theo%",
        "Waves Per SM": "waves", "Block Limit Registers": "blk_reg", "Dynamic Shared Memory Per Block": "dsmem",
        "Executed Ipc Active": "ipc", "Issue Slots Busy": "issue%", "No Eligible": "noelig%",
        "Warp Cycles Per Issued Instruction": "cyc/inst"}
cur = None; out = []
for line in open(os.path.join(o, "details.txt"), errors="replace"):
  if re.match(r"^  \S.*Context \d+, Stream", line):
    cur = {"k": line.split(" (")[0].strip()[:40] + " (" + line.split(")x(")[0].split(" (")[-1] + ")"}
    out.append(cur); continue
  if cur is None: continue
  for k, short in keys.items():
    m = re.match(r"^\s+" + re.escape(k) + r"\s+\S+\s+([\d.,]+)\s*$", line) or \
        re.match(r"^\s+" + re.escape(k) + r"\s+([\d.,]+)\s*$", line)
    if m and short not in cur:
      cur[short] = m.group(1)
for c in out:
  try:
    if float(c.get("us", "0").replace(",", "")) < 3: continue
  except ValueError: pass
  print(" ".join(f"{k}={v}" if k != "k" else v for k, v in c.items()))
PY
