# Server: moeserve launch
URL=${MOESERVE_URL:-http://127.0.0.1:8000}
moeserve bench serve --base-url "$URL" --num-prompts 8 --request-rate 4 \
    --random-input-len 16 --random-output-len 8 --goodput ttft:2000 tbt:500 --disable-tqdm
