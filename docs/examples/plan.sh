moeserve plan --model deepseek-v3 --gpus 16 --gpu h100 --slo-tbt-ms 50
