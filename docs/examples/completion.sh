# Server: moeserve launch
# A completion with curl; MOESERVE_URL defaults to the server `moeserve launch` starts.
URL=${MOESERVE_URL:-http://127.0.0.1:8000}
curl -sf "$URL/v1/completions" -H 'Content-Type: application/json' \
     -d '{"prompt": "def read_file(path):\n", "max_tokens": 32, "temperature": 0}'
