set -u
B=.dev/turbospark; V=/tmp/v2lite-q8_0.gguf
$B synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
EAGER=1 python3 tools/gpu/probe/moe_cublas.py 2>&1 | head -3
wait
NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
echo "nsys: $NSYS"
if [ -n "$NSYS" ]; then
  $NSYS profile -o $OUT/pp -t cuda --force-overwrite true $B bench --backend cuda -m $V -p 512 -n 0 -r 2 > $OUT/nsys_run.txt 2>&1
  $NSYS stats -r cuda_gpu_kern_sum,cuda_api_sum --format csv -o $OUT/st $OUT/pp.nsys-rep > /dev/null 2>&1
  ls $OUT
  head -25 $OUT/st_cuda_gpu_kern_sum.csv | cut -c1-220
  head -15 $OUT/st_cuda_api_sum.csv | cut -c1-200
fi
