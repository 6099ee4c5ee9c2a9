"""Lua run on a stream shard (a Redis server holding token streams but not the queue; see
protocol/stream_shards.py). Only used for jobs whose stream is not on the main Redis.

Fencing across two servers. On the main Redis a claim INCRs the job's fence counter and the
append script compares the lease with the caller's token, in the same script as the XADD. A
shard cannot see the main lease, so it keeps a copy of the fence, `Keys.stream_fence`:

- ADOPT runs right after a claim, before the worker generates anything: it raises the shard's
  fence to the new claim's token (tokens only grow, so an older claim can never lower it) and,
  in the same script, returns the stream as it is. From then on an append by any older owner is
  refused by the shard; whatever an older owner appended before is in what the new owner read,
  so it continues after it. The stream never holds two owners' tokens interleaved or a gap.
- APPEND checks the shard's fence against the caller's token before each job's XADDs; the
  worker also sends the main lease check (and renewal) in its main round trip of the same step,
  and drops a job whose lease either server refuses.
- END writes the final entry after the main Redis recorded the job's end (whose cancel guard
  decides the outcome), fenced the same way, and idempotent: a resent END finds its entry.

A shard restarted without its data loses the fence copies too: appends then find no fence and
are refused, the jobs' leases lapse, and recovery hands them on to a claim that adopts anew.
"""

from __future__ import annotations

# A job's tokens of one append as one entry at ARGV[a..a+3]: a single token's (index, token_id,
# text, logprobs: '' for none, then no `lp` field) at its explicit id 0-(index+1), or a run's
# (protocol/token_runs.py, encoded by the worker) at its last token's id; pcall, so that an id
# already there is an error reply the caller reads (a resent round trip) rather than the script's
# end. Shared with the main append (job_scripts.APPEND).
# [redis-cost] The step notification (protocol/stream_steps.py), one PUBLISH per script run: the
# caller's `tokens` (every token it sent, encoded by the worker) when each of them was written
# (the usual step), else the keys of the streams that got some (a refused job or a resent round
# trip: the hub reads those streams). Decided here, after the fence checks and the XADDs, so a
# notification never carries a token its stream lacks; passing the worker's encoding through
# costs Redis one argument, where building it in Lua cost about as much as the XADDs.
XADD_TOKEN = """
local written = {}  -- streams that got tokens in this run
local is_whole = true  -- every token sent was written: none refused or there already
-- Returns whether it notified the tokens themselves.
local function send_notes(steps, tokens)
  if is_whole and tokens ~= '' then
    redis.call('PUBLISH', steps, 'e' .. tokens)
    return true
  elseif #written > 0 then
    redis.call('PUBLISH', steps, 'k' .. table.concat(written, ' '))
  end
  return false
end
-- The one entry for a job's num_tokens tokens at ARGV[a..a+3]: (index, token_id, text,
-- logprobs) for one, at its id; a run (protocol/token_runs.py, encoded by the worker: first index,
-- token ids, texts, logprobs) for several, at its last token's id.
local function xadd(stream, a, num_tokens)
  local id = '0-' .. (tonumber(ARGV[a]) + num_tokens)
  local kind, ids_field = 'token', 'token_id'
  if num_tokens > 1 then kind, ids_field = 'tokens', 'token_ids' end
  if ARGV[a + 3] == '' then
    return redis.pcall('XADD', stream, id, 'kind', kind, 'index', ARGV[a],
                       ids_field, ARGV[a + 1], 'text', ARGV[a + 2])
  end
  return redis.pcall('XADD', stream, id, 'kind', kind, 'index', ARGV[a],
                     ids_field, ARGV[a + 1], 'text', ARGV[a + 2], 'lp', ARGV[a + 3])
end
-- The job's entry onto stream. Returns 1 (written), nil (there already: its id is not after the
-- stream's last, as when a round trip is resent, which sends the same entry again) or -1 (Redis
-- refused it for another reason, e.g. out of memory: the job must not go on as if it were there).
-- [redis-cost] One XADD, no read. A worker's entries are consecutive by construction (its tokens
-- follow its claim's reading of the stream, fencing keeps other writers out, and a retry resends
-- the same entries), so the stream is not read to check where it ends.
local function append_tokens(stream, a, num_tokens)
  local added = xadd(stream, a, num_tokens)
  if type(added) == 'table' and added.err then
    is_whole = false
    if string.find(tostring(added.err), 'equal or smaller', 1, true) then return nil end
    return -1
  end
  written[#written + 1] = stream
  return 1
end
"""

_NEXT_INDEX = """
-- The index the next token gets: explicit ids are 0-(index+1), so it is the last id's sequence.
local function next_index(stream)
  local last = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)
  if #last == 0 then return 0, nil end
  return tonumber(string.match(last[1][1], '%-(%d+)$')), last[1][2]
end
"""

# KEYS: (stream fence, stream) per job.  ARGV: keep_ms (TTL of an adopted stream until its job
#       ends: a job abandoned for good must not keep its stream forever), then a token per job.
# Returns per job {1, entries} (adopted: the stream as it is) or {0, {}} (a newer claim holds it).
SHARD_ADOPT = """
local keep_ms = tonumber(ARGV[1])
local replies = {}
for j = 1, #ARGV - 1 do
  local fence, stream, token = KEYS[2 * j - 1], KEYS[2 * j], ARGV[j + 1]
  local held = redis.call('GET', fence)
  if held and tonumber(held) > tonumber(token) then
    replies[j] = {0, {}}
  else
    redis.call('SET', fence, token, 'PX', keep_ms)
    if redis.call('EXISTS', stream) == 1 then redis.call('PEXPIRE', stream, keep_ms) end
    replies[j] = {1, redis.call('XRANGE', stream, '-', '+')}
  end
end
return replies
"""

# KEYS: (stream fence, stream) per job, then the step notifications (Keys.stream_steps).
# ARGV: the step's tokens as a notification carries them (protocol/stream_steps.py), then per
#       job: token, num_tokens, then its entry when num_tokens > 0: (index, token_id, text,
#       logprobs) for one token (logprobs '' when the job asked for none: no `lp` field is
#       written), a run's (first index, token ids, texts, logprobs) for several, as the main
#       append takes them.
# Returns per job 1 (appended, or there already: a resent round trip), 0 (refused: another claim
# adopted the stream), -1 (Redis refused the entry for another reason: the job is dropped).
SHARD_APPEND = XADD_TOKEN + """
local function append(fence, stream, token, a, num_tokens)
  if redis.call('GET', fence) ~= token then
    if num_tokens > 0 then is_whole = false end
    return 0
  end
  if num_tokens == 0 then return 1 end
  local written_now = append_tokens(stream, a, num_tokens)
  if written_now == nil then return 1 end
  if written_now == -1 then return -1 end
  -- A new stream expires with its fence copy until the job's end sets its TTL.
  if ARGV[a] == '0' then redis.call('PEXPIRE', stream, redis.call('PTTL', fence)) end
  return 1
end
local results = {}
local a, k = 2, 1
while a <= #ARGV do
  local num_tokens = tonumber(ARGV[a + 1])
  results[#results + 1] = append(KEYS[k], KEYS[k + 1], ARGV[a], a + 2, num_tokens)
  a = a + 2 + (num_tokens > 0 and 4 or 0)
  k = k + 2
end
send_notes(KEYS[#KEYS], ARGV[1])
return results
"""

# KEYS: stream fence, stream.
# ARGV: token, ttl_s (0: keep), finish_reason, prompt_tokens, completion_tokens, error,
#       cached_tokens.
# Returns 1 (written, or already there), 0 (refused: another claim adopted the stream).
SHARD_END = _NEXT_INDEX + """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local done, fields = next_index(KEYS[2])
if fields and fields[2] == 'done' then return 1 end
redis.call('XADD', KEYS[2], '0-' .. (done + 1), 'kind', 'done', 'finish_reason', ARGV[3],
           'prompt_tokens', ARGV[4], 'completion_tokens', ARGV[5], 'error', ARGV[6],
           'cached_tokens', ARGV[7])
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  redis.call('EXPIRE', KEYS[1], ttl)
  redis.call('EXPIRE', KEYS[2], ttl)
else
  redis.call('PERSIST', KEYS[1])
  redis.call('PERSIST', KEYS[2])
end
return 1
"""
