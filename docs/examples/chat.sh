# Server: moeserve launch
URL=${MOESERVE_URL:-http://127.0.0.1:8000}
curl -sf "$URL/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "messages": [{"role": "user", "content": "Name three prime numbers."}],
  "max_tokens": 24,
  "temperature": 0
}'
# Streamed: one server-sent event per chunk, then "data: [DONE]".
curl -sfN "$URL/v1/chat/completions" -H 'Content-Type: application/json' -d '{
  "messages": [{"role": "user", "content": "Name three prime numbers."}],
  "max_tokens": 8,
  "stream": true,
  "stream_options": {"include_usage": true}
}'
