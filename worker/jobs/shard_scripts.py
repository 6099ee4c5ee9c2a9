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

from protocol.stream_steps import STREAM_STEPS_MAXLEN

# One token entry at ARGV[a..a+3] (index, token_id, text, logprobs: '' for none, then no `lp`
# field), at its explicit id 0-(index+1); pcall, so that an id already there is an error reply the
# caller reads (a resent round trip) rather than the script's end; the tokens one append gets for
# a job, written as one entry (a run of several, protocol/token_runs.py). Shared with the main
# append (job_scripts.APPEND).
# [redis-cost] The step notification (protocol/stream_steps.py), one XADD per script run: the
# caller's `tokens` (every token it sent, encoded by the worker) when each of them was written
# (the usual step), else the keys of the streams that got some (a refused job or a resent round
# trip: the hub reads those streams). Decided here, after the fence checks and the XADDs, so a
# notification never carries a token its stream lacks; passing the worker's encoding through
# costs Redis one argument, where building it in Lua cost about as much as the XADDs.
XADD_TOKEN = """
local written = {}  -- streams that got tokens in this run
local is_whole = true  -- every token sent was written: none refused, skipped or after a gap
local function send_notes(steps, tokens)
  if is_whole and tokens ~= '' then
    redis.call('XADD', steps, 'MAXLEN', '~', """ + str(STREAM_STEPS_MAXLEN) + """, '*', 'e',
               tokens)
  elseif #written > 0 then
    redis.call('XADD', steps, 'MAXLEN', '~', """ + str(STREAM_STEPS_MAXLEN) + """, '*', 'k',
               table.concat(written, ' '))
  end
end
local function xadd(stream, a)
  local id = '0-' .. (tonumber(ARGV[a]) + 1)
  if ARGV[a + 3] == '' then
    return redis.pcall('XADD', stream, id, 'kind', 'token', 'index', ARGV[a],
                       'token_id', ARGV[a + 1], 'text', ARGV[a + 2])
  end
  return redis.pcall('XADD', stream, id, 'kind', 'token', 'index', ARGV[a],
                     'token_id', ARGV[a + 1], 'text', ARGV[a + 2], 'lp', ARGV[a + 3])
end
-- [redis-cost] The tokens at ARGV[a..last] (4 values each) as ONE entry: a run
-- (protocol/token_runs.py) at the last token's id when there are several, since Redis' cost
-- goes by entries (the XADD and its call from Lua), not by the tokens they hold.
local function xadd_run(stream, a, last)
  if a == last then return xadd(stream, a) end
  local token_ids, texts, logprobs, has_logprobs = {}, {}, {}, false
  for i = a, last, 4 do
    token_ids[#token_ids + 1] = ARGV[i + 1]
    texts[#texts + 1] = ARGV[i + 2]
    logprobs[#logprobs + 1] = ARGV[i + 3]
    if ARGV[i + 3] ~= '' then has_logprobs = true end
  end
  local id = '0-' .. (tonumber(ARGV[last]) + 1)
  if not has_logprobs then
    return redis.pcall('XADD', stream, id, 'kind', 'tokens', 'index', ARGV[a],
                       'token_ids', table.concat(token_ids, ' '), 'text', cjson.encode(texts))
  end
  return redis.pcall('XADD', stream, id, 'kind', 'tokens', 'index', ARGV[a],
                     'token_ids', table.concat(token_ids, ' '), 'text', cjson.encode(texts),
                     'lp', cjson.encode(logprobs))
end
-- The num_tokens tokens at ARGV[a..] (4 values each) onto stream, skipping those a resent round
-- trip already wrote. Returns the ARGV index of the first token written, nil when every one was
-- there already, or -1 for a gap (the stream's next index is not among them; nothing written).
-- Needs next_index (each script defines its own) before it.
local function append_from(stream, a, last)
  local expected = next_index(stream)
  local first = nil
  for i = a, last, 4 do
    if tonumber(ARGV[i]) >= expected then first = i; break end
  end
  if first == nil then return nil end
  if tonumber(ARGV[first]) ~= expected then return -1 end
  xadd_run(stream, first, last)
  return first
end
local function append_tokens(stream, a, num_tokens)
  local last = a + 4 * (num_tokens - 1)
  local first = a
  if num_tokens == 1 then
    -- One token: its XADD at its own id is refused when the stream has it already (a resent
    -- round trip), and only then is the stream's end read.
    local added = xadd(stream, a)
    if type(added) == 'table' and added.err then
      is_whole = false
      first = append_from(stream, a, last)
    end
  else
    -- A run is at its LAST token's id, which Redis would take after an earlier token of it, so
    -- where the stream ends is read first: a resent run skips what it finds, a gap is refused.
    first = append_from(stream, a, last)
    if first ~= a then is_whole = false end
  end
  if first == nil or first == -1 then return first end
  written[#written + 1] = stream
  return first
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
#       job: token, num_tokens, then (index, token_id, text, logprobs) per token (logprobs ''
#       when the job asked for none: no `lp` field is written), as the main append takes them.
# Returns per job 1 (appended), 0 (refused: another claim adopted the stream), -1 (gap: refused).
# A resent round trip finds its first tokens there: it skips them, as the main append does.
SHARD_APPEND = _NEXT_INDEX + XADD_TOKEN + """
local function append(fence, stream, token, a, num_tokens)
  if redis.call('GET', fence) ~= token then
    if num_tokens > 0 then is_whole = false end
    return 0
  end
  if num_tokens == 0 then return 1 end
  local first = append_tokens(stream, a, num_tokens)
  if first == nil then return 1 end
  if first == -1 then return -1 end
  -- A new stream expires with its fence copy until the job's end sets its TTL.
  if ARGV[first] == '0' then redis.call('PEXPIRE', stream, redis.call('PTTL', fence)) end
  return 1
end
local results = {}
local a, k = 2, 1
while a <= #ARGV do
  local num_tokens = tonumber(ARGV[a + 1])
  results[#results + 1] = append(KEYS[k], KEYS[k + 1], ARGV[a], a + 2, num_tokens)
  a = a + 2 + 4 * num_tokens
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
