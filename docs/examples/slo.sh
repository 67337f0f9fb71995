# Server: moeserve launch --slo-class interactive=ttft:500,tbt:50
URL=${MOESERVE_URL:-http://127.0.0.1:8000}
# The request's own latency targets, in milliseconds:
curl -sf "$URL/v1/completions" -H 'Content-Type: application/json' \
     -d '{"prompt": "Hello", "max_tokens": 8, "slo": {"ttft_ms": 2000, "tbt_ms": 200}}'
# A class the server defines (--slo-class NAME=ttft:MS,tbt:MS):
curl -sf "$URL/v1/chat/completions" -H 'Content-Type: application/json' \
     -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "slo": {"class": "interactive"}}'
# Attainment by class, as /metrics counts it:
curl -sf "$URL/metrics" | grep '^moeserve:slo_class_requests_total'
