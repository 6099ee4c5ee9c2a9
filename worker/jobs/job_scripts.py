"""The worker's Lua scripts: every job transition is one atomic script (claim, append, finish,
requeue, recover), so no crash or race can leave a job half-moved.

Fencing: a claim INCRs the job's fence counter and stores the new value as the job's lease (a
string with a PX TTL). append/finish/requeue first compare the lease with the caller's token and
refuse (write nothing) when it differs: a worker whose lease lapsed and was taken over can no
longer touch the job. Stream entries have explicit ids `0-(index+1)`, so Redis also refuses a
duplicate or out-of-order token.

RQ bookkeeping follows what an rq 3 worker writes (job status, execution records in the
StartedJobRegistry, results, finished/failed/canceled registries), with key names from
protocol.rq_keys and payloads built by rq's own classes on the Python side.

Claim and recover learn job ids while they run, so they build per-job keys from templates
(prefix + id + suffix, from protocol.Keys / RQKeys) instead of declaring them: fine on a
standalone Redis or a single-slot deployment (as BullMQ's scripts do), not on Redis Cluster.

Record timestamps (started/first token/finished) come from the worker's clock in ARGV so the
JobState hash and the RQ result agree; lease deadlines use Redis' own TIME, the one clock all
workers share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from redis import Redis
from redis.client import Pipeline
from redis.typing import EncodableT

from protocol.stream_steps import LIVE_WINDOW_MS
from protocol.webhook_events import EMIT_JOB_EVENT_LUA
from worker.jobs.fair_share import CLAIM_FAIR_PICK, requeue_to_owner_list, settle_owner_counter
from worker.jobs.shard_scripts import (
    JOURNAL_LIVE,
    LIVE_REPLAY,
    SHARD_ADOPT,
    SHARD_APPEND,
    SHARD_END,
    XADD_TOKEN,
)

_COMMON = """
local function is_final(status)
  return status == 'finished' or status == 'failed' or status == 'canceled'
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- The index the next token gets: explicit ids are 0-(index+1), so it is the last id's sequence.
local function next_index(stream)
  local last = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)
  if #last == 0 then return 0 end
  return tonumber(string.match(last[1][1], '%-(%d+)$'))
end
local function drop_execution(execution, started, executions, worker_executions, composite,
                              execution_id)
  redis.call('DEL', execution)
  redis.call('ZREM', started, composite)
  redis.call('ZREM', executions, execution_id)
  redis.call('SREM', worker_executions, composite)
end
"""

# KEYS: leases, canceled, this worker's RQ executions set, RQ worker hash,
#       then P queue keys, then P StartedJobRegistry keys, then P wake-up lists (priority order;
#       the queues of the one model this worker serves), then the fair-share weights, vtimes and
#       clock, then P owners sets (Keys.queue_owners) (worker/jobs/fair_share.py), then rq's
#       suspension flag (`rq suspend`).
# ARGV: worker_name, lease_ms, max_jobs, free_kv_blocks (-1: no limit), block_size,
#       adopt_job_id (already popped; '' for none), adopt_queue_index (1-based),
#       execution_ttl_s, rq_now (rq's UTC format), now_s (epoch float), execution_id_prefix, P,
#       templates (prefix, suffix): state 13, stream 15, lease 17, fence 19, rq job 21,
#       rq execution 23 (over the composite key), rq executions 25; composite separator 27;
#       fair-share default charge 28; this worker's stream shard 29 ('': the streams are not
#       sharded), recorded in the state of a job starting for the first time.
# Returns, per claimed job: {job_id, queue_index, fence, execution_id, rq data, result_ttl,
#       failure_ttl, JobState fields (flat), stream entries, is_canceled, restarted: '' or, for
#       an ended job that rq's requeue put back (run again from its start), the stream_shard its
#       old stream was placed by ('-1': none recorded), placed: 1 when this claim recorded the
#       job's stream shard (its first start: it has no stream anywhere yet), else 0}; or
#       CLAIM_SUSPENDED,
#       taking nothing, while `rq suspend` holds.
CLAIM_SUSPENDED = "suspended"
CLAIM = _COMMON + """
local P = tonumber(ARGV[12])
local function key(i, id) return ARGV[i] .. id .. ARGV[i + 1] end
local function queue_lengths()
  local lengths = {}
  for i = 1, P do lengths[i] = redis.call('LLEN', KEYS[4 + i]) end
  return lengths
end
-- One wake-up per job still queued: a wake-up whose job was taken (or canceled) would only wake
-- an idle worker for nothing.
local function trim_wakeups(lengths)
  for i = 1, P do
    if lengths[i] == 0 then
      redis.call('DEL', KEYS[4 + 2 * P + i])
    else
      redis.call('LTRIM', KEYS[4 + 2 * P + i], 0, lengths[i] - 1)
    end
  end
end
-- Every queue empty and nothing to adopt: what a worker with a free seat hears at most steps (it
-- asks at every step). Answer before the fair-share pass over every tier's owners: with four
-- tiers an empty claim runs 9 commands (the suspension's EXISTS among them), not 19 (SMEMBERS,
-- LINDEX per tier, the clock's GET, TIME). On a 2-vCPU EPYC VM the request's own wake-up is most
-- of its cost (README, "Fleet scale").
if ARGV[6] == '' then
  -- rq's contract for `rq suspend`: no new job starts; the running ones go on. (An adopted job
  -- was taken by an rq worker, which checked before it dequeued.)
  if redis.call('EXISTS', KEYS[#KEYS]) == 1 then return '""" + CLAIM_SUSPENDED + """' end
  local lengths = queue_lengths()
  local num_queued = 0
  for i = 1, P do num_queued = num_queued + lengths[i] end
  if num_queued == 0 then
    trim_wakeups(lengths)
    return {}
  end
end
""" + CLAIM_FAIR_PICK + """
local lease_ms = tonumber(ARGV[2])
local max_jobs = tonumber(ARGV[3])
local budget = tonumber(ARGV[4])
local block_size = tonumber(ARGV[5])
local ttl = tonumber(ARGV[8])
local deadline = now_ms() + lease_ms
local now_s = tonumber(ARGV[10])
local claimed = {}

-- KV blocks a job needs to be scheduled now: its prompt (once known) plus what it generated.
local function blocks_needed(job_id)
  local prompt = tonumber(redis.call('HGET', key(13, job_id), 'prompt_tokens') or '0') or 0
  -- Its tokens: the last id's sequence (an entry may hold several: protocol/token_runs.py).
  local generated = next_index(key(15, job_id))
  return math.ceil((prompt + generated + 1) / block_size)
end

-- The cancel set, read once a call and only when a job is claimed: empty but between a cancel
-- request and its worker acting on it.
local any_canceled = nil
local function is_canceled(job_id)
  if any_canceled == nil then any_canceled = redis.call('SCARD', KEYS[2]) > 0 end
  return any_canceled and redis.call('SISMEMBER', KEYS[2], job_id) or 0
end

-- [redis-cost] The job's state hash is read once (HGETALL, which the worker gets back anyway)
-- and written once: its status, started_at and fair-share charge come from that read, not from
-- a command each (a claim was 31 commands a job; about a third went to the state hash).
local function claim(job_id, qi)
  local state = key(13, job_id)
  local rq_job = key(21, job_id)
  -- An RQ job hash always holds its data (rq's Job.to_dict): none means deleted meanwhile, and
  -- the stale id is dropped.
  local rq_fields = redis.call('HMGET', rq_job, 'data', 'result_ttl', 'failure_ttl', 'status')
  if not rq_fields[1] then return end
  local flat = redis.call('HGETALL', state)
  local fields = {}
  for i = 1, #flat, 2 do fields[flat[i]] = flat[i + 1] end
  local restarted = ''
  if is_final(fields.status) then
    -- rq's requeue (`rq requeue`, rq-dashboard's Requeue, Job.requeue) puts an ended job back
    -- as queued: it runs again from its start, as rq reruns a requeued job. Any other ended
    -- job's id on a queue is stale (canceled while queued) and is dropped.
    if rq_fields[4] ~= 'queued' then return end
    restarted = fields.stream_shard or '-1'
    local ended = {'finish_reason', 'error', 'completion_tokens', 'text', 'token_ids',
                   'finished_at', 'first_token_at', 'cached_tokens', 'execution', 'fair_charge',
                   'fair_weight', 'prompt_logprobs', 'stream_shard'}
    redis.call('HDEL', state, unpack(ended))
    for _, name in ipairs(ended) do fields[name] = nil end
    fields.started_at = nil
    -- The ended job's keys expire with its retention: this run keeps them.
    redis.call('PERSIST', state)
    redis.call('PERSIST', key(19, job_id))
    -- Its old stream, where it is on this Redis (on a stream shard the worker deletes it).
    redis.call('DEL', key(15, job_id))
  end
  local fence = redis.call('INCR', key(19, job_id))
  redis.call('SET', key(17, job_id), fence, 'PX', lease_ms)
  redis.call('ZADD', KEYS[1], deadline, job_id)
  -- rq's execution record, as rq.executions.Execution.create writes it.
  local execution_id = ARGV[11] .. fence
  local composite = job_id .. ARGV[27] .. execution_id
  local execution = key(23, composite)
  redis.call('HSET', execution, 'id', execution_id, 'job_id', job_id, 'created_at', ARGV[10],
             'last_heartbeat', ARGV[10], 'worker_name', ARGV[1])
  redis.call('EXPIRE', execution, ttl)
  local executions = key(25, job_id)
  redis.call('ZADD', executions, math.floor(now_s) + ttl + 60, execution_id)
  redis.call('EXPIRE', executions, ttl + 60)
  redis.call('ZADD', KEYS[4 + P + qi], math.floor(now_s) + ttl, composite)
  redis.call('SADD', KEYS[3], composite)  -- its EXPIRE once a call, below
  redis.call('HSET', rq_job, 'status', 'started', 'started_at', ARGV[9], 'last_heartbeat', ARGV[9],
             'worker_name', ARGV[1])
  redis.call('PERSIST', rq_job)
  local updates = {'status', 'running', 'worker', ARGV[1], 'execution', composite}
  local placed = 0
  if (tonumber(fields.started_at or '0') or 0) == 0 then
    updates[#updates + 1] = 'started_at'
    updates[#updates + 1] = ARGV[10]
    -- [redis-cost] Its stream's shard: this worker's (protocol/stream_shards.py), recorded at
    -- its first start only (a resumed job keeps the shard its stream is on).
    if ARGV[29] ~= '' then
      updates[#updates + 1] = 'stream_shard'
      updates[#updates + 1] = ARGV[29]
      placed = 1
    end
  end
  if not fields.job_id then  -- a job enqueued without submit_job
    updates[#updates + 1] = 'job_id'
    updates[#updates + 1] = job_id
  end
  fair_charge(fields, updates)  -- [fair-share]
  redis.call('HSET', state, unpack(updates))
  for i = 1, #updates, 2 do fields[updates[i]] = updates[i + 1] end
  flat = {}
  for name, value in pairs(fields) do
    flat[#flat + 1] = name
    flat[#flat + 1] = value
  end
  claimed[#claimed + 1] = {job_id, qi, fence, execution_id, rq_fields[1],
                           rq_fields[2] or '', rq_fields[3] or '', flat,
                           redis.call('XRANGE', key(15, job_id), '-', '+'),
                           is_canceled(job_id), restarted, placed}
end

if ARGV[6] ~= '' then
  fair_forget(ARGV[6], tonumber(ARGV[7]))  -- [fair-share]
  claim(ARGV[6], tonumber(ARGV[7]))
end
local qi = 1
while #claimed < max_jobs and qi <= P do
  local head, owner_list = fair_next(qi)  -- [fair-share] was: LINDEX queue 0
  if not head then
    qi = qi + 1
  else
    local need = 0
    if budget >= 0 then
      -- Leave a job this worker cannot schedule now for one that can (and keep queue order).
      need = blocks_needed(head)
      if need > budget then break end
    end
    if fair_take(qi, head, owner_list) then  -- [fair-share] was: LPOP queue
      if budget >= 0 then budget = budget - need end
      claim(head, qi)
    end
  end
end
fair_save()  -- [fair-share]
trim_wakeups(queue_lengths())
if #claimed > 0 then
  redis.call('EXPIRE', KEYS[3], ttl + 60)
  redis.call('HSET', KEYS[4], 'state', 'busy')
end
return claimed
"""

# The per-iteration call, for every job in the batch at once (one script, not one per job).
# KEYS: leases, canceled, this worker's live fence (Keys.live_fence), then (lease, stream, state)
#       per job written to its stream, then the step notifications (Keys.stream_steps;
#       [redis-cost]), then this worker's live journal (Keys.live_journal).
# ARGV: lease_ms, renew ('1': renew every lease of the batch, '0': not this step; a renewing
#       step has no live job), the step's tokens as a notification carries them ([redis-cost]
#       protocol/stream_steps.py), the number of live jobs (their tokens are in the notification
#       only: "Live tokens" in protocol/stream_steps.py), the oldest of their stream_complete_ms
#       (Redis' clock when a job's stream last held every token notified), the worker's live
#       epoch ('' for a worker without live tokens), then per job written to its stream:
#       job_id, token, prompt_tokens, first_token_at, prompt_logprobs (the encoded list, only in
#       the append that carries token 0 of a job that asked for them; else ''), num_tokens and,
#       when num_tokens > 0, the job's one entry: (index, token_id, text, logprobs) for one token
#       (logprobs '' when the job asked for none: no `lp` field is written), a run's (first
#       index, token ids, texts, logprobs) for several (protocol/token_runs.py).
#       prompt_logprobs goes into the state hash in the same HSET as first_token_at, so a
#       resumed job has them exactly once.
#       A job whose stream is on a shard (protocol.stream_shards) comes with no tokens, for its
#       lease check, renewal and cancel flag, and with first_token_at ('' or the time) when its
#       shard got its first token this step.
# Returns {results, cancel flags, notified, now_ms, live, canceled ids}: per job written to its
#       stream, the result — 1 (appended, or there already: a resent round trip, whose entry's id
#       Redis refuses; lease renewed if asked), 0 (refused: not the lease holder), -1 (Redis
#       refused the entry for another reason) — and the cancel flag (1: cancel requested);
#       whether the notification carried the tokens (if not, no live job's tokens went
#       anywhere); Redis' clock; for the live jobs 1 (notified) or 2 (not: the live fence is
#       gone or the oldest live stream is past the live window; the worker writes their streams
#       next, where each job's own lease decides); with live jobs while some job is canceled,
#       every canceled job id (the worker picks its own).
# Per job the hot path is GET (the fence) and one XADD; a live job costs nothing but its bytes
# in the notification (the live fence is one GET a step). PEXPIRE and ZADD only on renewing
# steps, SISMEMBER only while some job is canceled.
APPEND = _COMMON + XADD_TOKEN + JOURNAL_LIVE + """
local lease_ms = tonumber(ARGV[1])
local renew = ARGV[2] == '1'
local now = now_ms()
local deadline = renew and now + lease_ms or 0
-- The cancel set is empty but between a cancel request and its worker acting on it.
local any_canceled = redis.call('SCARD', KEYS[2]) > 0
-- The state fields the first token brings.
local function first_token(state, first_token_at, prompt_tokens, prompt_logprobs)
  if prompt_logprobs ~= '' then
    redis.call('HSET', state, 'first_token_at', first_token_at, 'prompt_tokens', prompt_tokens,
               'prompt_logprobs', prompt_logprobs)
  else
    redis.call('HSET', state, 'first_token_at', first_token_at, 'prompt_tokens', prompt_tokens)
  end
end
local function append(lease, stream, state, job_id, token, prompt_tokens, first_token_at,
                      prompt_logprobs, a, num_tokens)
  if redis.call('GET', lease) ~= token then
    if num_tokens > 0 then is_whole = false end  -- [redis-cost]
    return 0
  end
  if num_tokens > 0 then
    local written_now = append_tokens(stream, a, num_tokens)
    if written_now == -1 then return -1 end
    if written_now ~= nil and ARGV[a] == '0' then
      first_token(state, first_token_at, prompt_tokens, prompt_logprobs)
    end
  end
  if num_tokens == 0 and first_token_at ~= '' then
    -- The job's stream is on a shard, which got its first token this step.
    first_token(state, first_token_at, prompt_tokens, prompt_logprobs)
  end
  if renew then
    redis.call('PEXPIRE', lease, lease_ms)
    redis.call('ZADD', KEYS[1], 'XX', deadline, job_id)
  end
  return 1
end
local results, canceled = {}, {}
local num_live, epoch = tonumber(ARGV[4]), ARGV[6]
-- [redis-cost] Live jobs: one GET for all of them (the live fence), nothing per job.
local live = 1
if num_live > 0 and (redis.call('GET', KEYS[3]) ~= epoch
                     or now - tonumber(ARGV[5]) > """ + str(LIVE_WINDOW_MS) + """) then
  live = 2
  is_whole = false
end
local every_lease_held = true
local a = 7
local k = 4
while a <= #ARGV do
  local job_id, num_tokens = ARGV[a], tonumber(ARGV[a + 5])
  results[#results + 1] = append(KEYS[k], KEYS[k + 1], KEYS[k + 2], job_id, ARGV[a + 1],
                                 ARGV[a + 2], ARGV[a + 3], ARGV[a + 4], a + 6, num_tokens)
  if results[#results] ~= 1 then every_lease_held = false end
  canceled[#canceled + 1] = any_canceled and redis.call('SISMEMBER', KEYS[2], job_id) or 0
  a = a + 6 + (num_tokens > 0 and 4 or 0)
  k = k + 3
end
-- The live fence lives as long as the leases it vouches for, and only while each of them held.
if renew and epoch ~= '' then
  if every_lease_held then
    redis.call('SET', KEYS[3], epoch, 'PX', lease_ms)
  else
    redis.call('DEL', KEYS[3])
  end
end
local canceled_ids = {}
if any_canceled and num_live > 0 then canceled_ids = redis.call('SMEMBERS', KEYS[2]) end
-- [redis-cost] the step notification (shard_scripts.XADD_TOKEN)
local notified = send_notes(KEYS[#KEYS - 1], ARGV[3])
if notified and num_live > 0 then
  -- What recovery writes into the streams of this worker's jobs if it dies (RECOVER).
  journal_live(KEYS[#KEYS], now, ARGV[3])
end
return {results, canceled, notified and 1 or 0, now, live, canceled_ids}
"""

# KEYS: lease, stream, leases, state, canceled, rq job, rq results, rq execution,
#       rq executions, started registry, finished registry, failed registry, canceled registry,
#       worker executions, rq worker hash, fence, webhook events, the model's fair-share vtimes,
#       the step notifications (Keys.stream_steps: the final entry goes there too, `f`).
# ARGV: token, job_id, outcome (finished|failed|canceled), finish_reason, error, prompt_tokens,
#       completion_tokens, text, token_ids (JSON), result_ttl, failure_ttl, composite,
#       execution_id, rq_now, now_s, working_seconds, exc_info, cached_tokens, stream_here ('1':
#       the stream is on this Redis; '0': on a shard, whose END script the worker sends once this
#       ran), then rq Result fields as pairs.
# Returns the status written, or false when refused (not the lease holder / already final).
FINISH = _COMMON + EMIT_JOB_EVENT_LUA + """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return false end
-- [redis-cost] What this script reads of the state hash, in one command.
local job = redis.call('HMGET', KEYS[4], 'status', 'fair_charge', 'fair_weight', 'owner',
                       'webhook_url')
if is_final(job[1]) then return false end
local job_id = ARGV[2]
local outcome = ARGV[3]
local reason = ARGV[4]
local cancel_asked = redis.call('SISMEMBER', KEYS[5], job_id) == 1
-- The guard: a job canceled while running ends canceled, even if it finished meanwhile.
if outcome == 'finished' and cancel_asked then
  outcome = 'canceled'
  reason = 'canceled'
end
""" + settle_owner_counter("KEYS[18]", "job[2]", "job[3]", "job[4]") + """
local ttl = tonumber(ARGV[10])
if outcome == 'failed' then ttl = tonumber(ARGV[11]) end
local now_s = tonumber(ARGV[15])
local stream_here = ARGV[19] == '1'
if stream_here then
  local done = next_index(KEYS[2])
  local id = '0-' .. (done + 1)
  local fields = {'kind', 'done', 'finish_reason', reason, 'prompt_tokens', ARGV[6],
                  'completion_tokens', ARGV[7], 'error', ARGV[5], 'cached_tokens', ARGV[18]}
  redis.call('XADD', KEYS[2], id, unpack(fields))
  -- [redis-cost] The entry itself to the stream hubs (protocol/stream_steps.py, `f`): they hand
  -- it out without reading the stream.
  redis.call('PUBLISH', KEYS[19], 'f' .. cjson.encode({KEYS[2], id, unpack(fields)}))
end
redis.call('HSET', KEYS[4], 'status', outcome, 'finish_reason', reason, 'error', ARGV[5],
           'prompt_tokens', ARGV[6], 'completion_tokens', ARGV[7], 'text', ARGV[8],
           'token_ids', ARGV[9], 'finished_at', ARGV[15], 'execution', '',
           'cached_tokens', ARGV[18])
redis.call('HSET', KEYS[6], 'status', outcome, 'ended_at', ARGV[14])
if outcome == 'canceled' then
  redis.call('ZADD', KEYS[13], math.floor(now_s), job_id)
else
  if outcome == 'failed' then
    redis.call('HSET', KEYS[6], 'exc_info', ARGV[17])
    redis.call('ZADD', KEYS[12], math.floor(now_s) + ttl, job_id)
  else
    redis.call('ZADD', KEYS[11], math.floor(now_s) + ttl, job_id)
  end
  local result = {}
  for i = 20, #ARGV do result[#result + 1] = ARGV[i] end
  redis.call('XADD', KEYS[7], 'MAXLEN', '~', 10, '*', unpack(result))
  redis.call('EXPIRE', KEYS[7], ttl)
end
drop_execution(KEYS[8], KEYS[10], KEYS[9], KEYS[14], ARGV[12], ARGV[13])
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[3], job_id)
if cancel_asked then redis.call('SREM', KEYS[5], job_id) end
-- rq's worker hash counts successes and failures only: a canceled job is neither, so `rq info`'s
-- per-worker counts add up to the queue's finished and failed registries.
if outcome == 'failed' then
  redis.call('HINCRBY', KEYS[15], 'failed_job_count', 1)
elseif outcome == 'finished' then
  redis.call('HINCRBY', KEYS[15], 'successful_job_count', 1)
end
redis.call('HINCRBYFLOAT', KEYS[15], 'total_working_time', ARGV[16])
-- >>> webhooks: the job's final event (job.completed/failed/canceled/expired), in the script
-- that writes its final status, past the guards that refuse a job already final: one per job.
emit_hooked_job_event(KEYS[17], job[5], job[4], job_id, outcome, reason, ARGV[6], ARGV[7],
                      ARGV[5])
-- <<< webhooks
if ttl > 0 then
  for _, k in ipairs({KEYS[4], KEYS[6], KEYS[16]}) do redis.call('EXPIRE', k, ttl) end
  if stream_here then redis.call('EXPIRE', KEYS[2], ttl) end
end
return outcome
"""

# KEYS: lease, leases, state, rq job, queue (the job's origin), started registry, rq execution,
#       rq executions, worker executions, stream, the queue's wake-up list, its owners set
#       (Keys.queue_owners).
# ARGV: token, job_id, composite, execution_id, prompt_tokens, count_as_preemption (1|0),
#       num_tokens (what the job's stream holds, wherever it lives), unplace ('1': a job whose
#       first start this was, and whose stream shard could not be reached: it goes back as never
#       started, for the next claim to place it on its own worker's shard; absent: '0').
# Returns 1 (back at the queue's front), 0 (refused: not the lease holder).
REQUEUE = _COMMON + """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local status = 'queued'
if redis.call('XLEN', KEYS[10]) > 0 or tonumber(ARGV[7]) > 0 then status = 'preempted' end
redis.call('HSET', KEYS[3], 'status', status, 'prompt_tokens', ARGV[5], 'execution', '')
if ARGV[6] == '1' then redis.call('HINCRBY', KEYS[3], 'num_preemptions', 1) end
if ARGV[8] == '1' then redis.call('HDEL', KEYS[3], 'stream_shard', 'started_at') end
redis.call('HSET', KEYS[4], 'status', 'queued')
drop_execution(KEYS[7], KEYS[6], KEYS[8], KEYS[9], ARGV[3], ARGV[4])
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[2])
redis.call('LPUSH', KEYS[5], ARGV[2])
redis.call('LPUSH', KEYS[11], 1)
""" + requeue_to_owner_list("KEYS[12]", "KEYS[3]", "ARGV[2]") + """
return 1
"""

# KEYS: leases, the step notifications (Keys.stream_steps).
# ARGV: max_jobs, templates (prefix, suffix): state 2, stream 4, lease 6, rq job 8,
#       rq execution 10, rq executions 12, rq queue 14, started 16, failed 18,
#       worker executions 20, wake-ups (around the queue name) 22; composite separator 24;
#       owners set (around the queue name, Keys.queue_owners) 25; live journal (around the worker
#       name) 27; live fence (around the worker name) 29.
# Returns the ids put back at the front of their queue.
# A job's live tokens (notified to subscribers, not yet in its stream: protocol/stream_steps.py)
# are in its dead owner's journal: they go into the stream, as one run, before the job is queued,
# so whoever resumes it continues after them; and the owner's live fence goes, so that it cannot
# notify more (were it alive after all, its next append learns each job's fate from its lease).
# (shard_scripts.LIVE_REPLAY; a job streaming to a shard has its live tokens there, written by
# the next claim's adoption, shard_scripts.SHARD_ADOPT.)
RECOVER = _COMMON + XADD_TOKEN + LIVE_REPLAY + """
local function key(i, id) return ARGV[i] .. id .. ARGV[i + 1] end
local now = now_ms()
local recovered = {}
for _, job_id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, ARGV[1])) do
  local lease_ttl = redis.call('PTTL', key(6, job_id))
  local state = key(2, job_id)
  local status = redis.call('HGET', state, 'status')
  local origin = redis.call('HGET', key(8, job_id), 'origin')
  if lease_ttl > 0 then
    -- Still held (its deadline here lagged a renewal): move the deadline, leave the job.
    redis.call('ZADD', KEYS[1], now + lease_ttl, job_id)
  elseif not status or is_final(status) or not origin then
    redis.call('ZREM', KEYS[1], job_id)
  else
    local rq_job = key(8, job_id)
    local composite = redis.call('HGET', state, 'execution') or ''
    local worker = redis.call('HGET', state, 'worker') or ''
    if worker ~= '' then
      redis.call('DEL', key(29, worker))
      write_live_tokens(key(27, worker), key(4, job_id))
    end
    if composite ~= '' then
      local execution_id = string.sub(composite, #job_id + #ARGV[24] + 1)
      drop_execution(key(10, composite), key(16, origin), key(12, job_id), key(20, worker),
                     composite, execution_id)
    end
    -- RQ's own cleanup may have failed it first (abandoned job): undo that.
    if redis.call('HGET', rq_job, 'status') == 'failed' then
      redis.call('ZREM', key(18, origin), job_id)
      redis.call('PERSIST', rq_job)
    end
    redis.call('HSET', rq_job, 'status', 'queued')
    local new_status = 'queued'
    if redis.call('XLEN', key(4, job_id)) > 0 then new_status = 'preempted' end
    redis.call('HSET', state, 'status', new_status, 'execution', '')
    redis.call('HINCRBY', state, 'num_recoveries', 1)
    redis.call('LPUSH', key(14, origin), job_id)
    redis.call('LPUSH', key(22, origin), 1)
""" + requeue_to_owner_list("key(25, origin)", "state", "job_id") + """
    redis.call('ZREM', KEYS[1], job_id)
    recovered[#recovered + 1] = job_id
  end
end
send_notes(KEYS[2], '')  -- names the streams that got live tokens (no tokens of its own)
return recovered
"""


@dataclass(slots=True)
class ScriptShas:
    claim: str
    append: str
    finish: str
    requeue: str
    recover: str
    shard_adopt: str
    shard_append: str
    shard_end: str


class JobScripts:
    """Loads the scripts once (SCRIPT LOAD) and queues EVALSHA calls by name of transition.

    Pipelines get plain EVALSHA (redis-py's Script objects would add a SCRIPT EXISTS round trip
    to every pipeline); after a Redis restart or SCRIPT FLUSH the caller sees NoScriptError,
    calls `load` again and retries.
    """

    SOURCES = {"claim": CLAIM, "append": APPEND, "finish": FINISH, "requeue": REQUEUE,
               "recover": RECOVER, "shard_adopt": SHARD_ADOPT, "shard_append": SHARD_APPEND,
               "shard_end": SHARD_END}

    def __init__(self) -> None:
        self.shas: ScriptShas | None = None

    def load(self, redis: Redis) -> ScriptShas:
        self.shas = ScriptShas(**{name: redis.script_load(source)
                                  for name, source in self.SOURCES.items()})
        return self.shas

    def _sha(self, name: str) -> str:
        if self.shas is None:
            raise RuntimeError("JobScripts.load(redis) must run before scripts are called")
        return cast(str, getattr(self.shas, name))

    def call(self, target: Redis | Pipeline, name: str, keys: Sequence[str],
             args: Sequence[EncodableT]) -> Any:
        return target.evalsha(self._sha(name), len(keys), *keys, *args)
