"""Run another benchmark script with the rows kernel's few-rows tiers switched off (its A/B):

    python3 benchmarks/_without_few_rows_tier.py benchmarks/_model_kernels.py bert --pit
"""
import runpy, sys
import pit_tvm.schedules.wgmma as w
w.wgmma_few_rows_tiers = lambda *a, **k: []
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
