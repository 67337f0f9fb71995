# Server: moeserve launch
URL=${MOESERVE_URL:-http://127.0.0.1:8000}
curl -sf "$URL/metrics" | grep -E '^moeserve:(num_requests_running|kv_cache_blocks_used|slo_requests_total)'
