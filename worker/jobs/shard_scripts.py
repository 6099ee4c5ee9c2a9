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

Live tokens (protocol/stream_steps.py) work on a shard as on the main Redis, with the worker's
live fence and live journal on the shard (one of each per worker and shard it streams to):
APPEND notifies a step's live tokens only while the worker's live fence there holds its epoch
(set by a renewing step whose every fence copy on the shard held), and journals them. The main
Redis' recovery cannot reach a shard, so ADOPT does its part: the shard records which worker
adopted each stream (`Keys.stream_owner`), and the next adoption deletes that worker's live
fence and writes its journaled tokens into the stream before raising the fence, in one script:
the tokens subscribers got live are in the stream the new owner continues after, and the old
owner can notify no more (its next renewal on the shard finds the fence copy taken).
"""

from __future__ import annotations

from protocol.stream_steps import LIVE_JOURNAL_TTL_MS, LIVE_WINDOW_MS

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

SHARD_NOW_MS = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# A dead (or superseded) owner's live tokens into a stream, from its live journal: shared by the
# main Redis' RECOVER and a shard's ADOPT. Needs XADD_TOKEN's `written` and a `next_index`.
# The journal holds only what passed the owner's live fence; a later index replaces an earlier
# one (an older claim's tokens at those indices are in the stream already, and skipped).
LIVE_REPLAY = """
local journals = {}  -- journal key -> stream key -> index -> {token_id, text, logprobs}
local function live_tokens(journal)
  local by_stream = journals[journal]
  if by_stream then return by_stream end
  by_stream = {}
  for _, entry in ipairs(redis.call('XRANGE', journal, '-', '+')) do
    local notes = cjson.decode(entry[2][2])
    for i = 1, #notes, 2 do
      local tokens = by_stream[notes[i]] or {}
      local values = notes[i + 1]
      for v = 1, #values, 4 do
        tokens[tonumber(values[v])] = {values[v + 1], values[v + 2], values[v + 3]}
      end
      by_stream[notes[i]] = tokens
    end
  end
  journals[journal] = by_stream
  return by_stream
end
local function write_live_tokens(journal, stream)
  local tokens = live_tokens(journal)[stream]
  if not tokens then return end
  local first = next_index(stream)
  local ids, texts, logprobs, has_logprobs = {}, {}, {}, false
  local index = first
  while tokens[index] do
    local token = tokens[index]
    ids[#ids + 1], texts[#texts + 1], logprobs[#logprobs + 1] = token[1], token[2], token[3]
    if token[3] ~= '' then has_logprobs = true end
    index = index + 1
  end
  if #ids == 0 then return end
  -- A run (protocol/token_runs.py) at its last token's id; notified (`written`, XADD_TOKEN's),
  -- so hubs read the stream at once.
  local fields = {'kind', 'tokens', 'index', first, 'token_ids', table.concat(ids, ' '),
                  'text', cjson.encode(texts)}
  if has_logprobs then
    fields[#fields + 1], fields[#fields + 2] = 'lp', cjson.encode(logprobs)
  end
  redis.call('XADD', stream, '0-' .. index, unpack(fields))
  written[#written + 1] = stream
end
"""

# The step's live tokens into the worker's live journal: what a resumer writes into the streams
# if the worker dies (RECOVER on the main Redis, ADOPT on a shard), trimmed to two live windows.
JOURNAL_LIVE = """
local function journal_live(journal, now, tokens)
  redis.call('XADD', journal, 'MINID', '~', now - 2 * """ + str(LIVE_WINDOW_MS) + """, '*', 'e',
             tokens)
  redis.call('PEXPIRE', journal, """ + str(LIVE_JOURNAL_TTL_MS) + """)
end
"""

# KEYS: (stream fence, stream, stream owner) per job, then the step notifications.
# ARGV: keep_ms (TTL of an adopted stream until its job ends: a job abandoned for good must not
#       keep its stream forever), the adopting worker's name, templates (prefix, suffix) of a
#       worker's live journal 3 and live fence 5 (around its name), then a token per job.
# Returns per job {1, entries} (adopted: the stream as it is, with the previous owner's live
# tokens written in) or {0, {}} (a newer claim holds it).
SHARD_ADOPT = XADD_TOKEN + _NEXT_INDEX + LIVE_REPLAY + """
local keep_ms, worker = tonumber(ARGV[1]), ARGV[2]
local function key(i, name) return ARGV[i] .. name .. ARGV[i + 1] end
local replies = {}
for j = 1, #ARGV - 6 do
  local fence, stream, owner, token = KEYS[3 * j - 2], KEYS[3 * j - 1], KEYS[3 * j], ARGV[j + 6]
  local held = redis.call('GET', fence)
  if held and tonumber(held) > tonumber(token) then
    replies[j] = {0, {}}
  else
    local previous = redis.call('GET', owner)
    if previous then
      redis.call('DEL', key(5, previous))
      write_live_tokens(key(3, previous), stream)
    end
    redis.call('SET', fence, token, 'PX', keep_ms)
    redis.call('SET', owner, worker, 'PX', keep_ms)
    if redis.call('EXISTS', stream) == 1 then redis.call('PEXPIRE', stream, keep_ms) end
    replies[j] = {1, redis.call('XRANGE', stream, '-', '+')}
  end
end
send_notes(KEYS[#KEYS], '')  -- names the streams that got live tokens
return replies
"""

# KEYS: (stream fence, stream) per job written to its stream, then the step notifications
#       (Keys.stream_steps), this worker's live fence and live journal on this shard.
# ARGV: the step's tokens as a notification carries them (protocol/stream_steps.py), lease_ms
#       (the live fence's TTL), renew ('1': a renewing step, every job of the worker on this
#       shard is written to its stream), the number of live jobs (their tokens are in the
#       notification only), the oldest of their stream_complete_ms (this shard's clock), the
#       worker's live epoch, then per job written to its stream: token, num_tokens, then its
#       entry when num_tokens > 0: (index, token_id, text, logprobs) for one token (logprobs ''
#       when the job asked for none: no `lp` field is written), a run's (first index, token ids,
#       texts, logprobs) for several, as the main append takes them.
# Returns {results, notified, now_ms, live}: per job written, 1 (appended, or there already: a
# resent round trip), 0 (refused: another claim adopted the stream), -1 (Redis refused the entry
# for another reason: the job is dropped); whether the notification carried the tokens; this
# shard's clock; for the live jobs 1 (notified) or 2 (not: the live fence is gone or the oldest
# live stream is past the live window; the worker writes their streams next).
# [redis-cost] Per job written, GET (its fence copy) and one XADD; a live job costs nothing but
# its bytes in the notification and the journal (the live fence is one GET a step).
SHARD_APPEND = XADD_TOKEN + SHARD_NOW_MS + JOURNAL_LIVE + """
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
local lease_ms, renew, num_live, epoch = ARGV[2], ARGV[3] == '1', tonumber(ARGV[4]), ARGV[6]
local steps, live_fence, journal = KEYS[#KEYS - 2], KEYS[#KEYS - 1], KEYS[#KEYS]
local now = now_ms()
local live = 1
if num_live > 0 and (redis.call('GET', live_fence) ~= epoch
                     or now - tonumber(ARGV[5]) > """ + str(LIVE_WINDOW_MS) + """) then
  live = 2
  is_whole = false
end
local results = {}
local every_fence_held = true
local a, k = 7, 1
while a <= #ARGV do
  local num_tokens = tonumber(ARGV[a + 1])
  results[#results + 1] = append(KEYS[k], KEYS[k + 1], ARGV[a], a + 2, num_tokens)
  if results[#results] ~= 1 then every_fence_held = false end
  a = a + 2 + (num_tokens > 0 and 4 or 0)
  k = k + 2
end
-- The live fence vouches for the fence copies of every job the worker streams here, for a
-- lease's time: set by a renewing step (which writes each of them) that found them all.
if renew and epoch ~= '' then
  if every_fence_held then
    redis.call('SET', live_fence, epoch, 'PX', lease_ms)
  else
    redis.call('DEL', live_fence)
  end
end
local notified = send_notes(steps, ARGV[1])
if notified and num_live > 0 then journal_live(journal, now, ARGV[1]) end
return {results, notified and 1 or 0, now, live}
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
