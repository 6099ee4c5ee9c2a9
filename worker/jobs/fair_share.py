"""Fair shares between API keys: the Lua the claim script (job_scripts.CLAIM) uses to choose,
within one priority tier, whose job boards next, the index it chooses from, and the finish
script's settlement.

The design, and why:
- Where: in the claim, the one atomic script every worker of a model runs to take jobs, so the
  choice is fleet-wide (all workers read and charge the same counters) and a crash never loses a
  job (the pick, its removal from the RQ queue and the claim bookkeeping are one script).
- What: each owner (API key id, `JobSpec.owner`) has a virtual token counter per model
  (`Keys.fair_vtimes`): tokens charged / the key's weight (`Keys.fair_weights`, written by the
  API from its settings). Within a tier the claim serves the owner with the lowest counter,
  taking that owner's oldest queued job; ties go to the owner whose oldest job was created
  first (then the smaller owner id), so a lone owner keeps plain FIFO order. Every competing
  owner's counter then advances at the same rate, so the tokens each generates are in proportion
  to its weight: weighted fair queueing, with tokens as the unit of work.
- When charged: at the claim, the job's max_tokens (recorded in its JobState), settled to the
  tokens it really generated when it ends (the finish script). Charging up front makes every
  worker see a claim at once (two workers claiming in the same instant must not both pick the
  same owner for lack of a charge), and costs nothing per token: the append script is untouched,
  the counters move twice per job. The price: a job that stops far before its max_tokens
  over-charges its owner until it ends. A preempted or recovered job is charged once, at its
  first claim (`fair_charge` in its state hash).
- No banked credit: the model's virtual clock (`Keys.fair_clock`) is the counter of the owner
  served last, which only grows; an owner's counter counts as at least the clock, so a key that
  was idle (or had no job queued) re-enters at the current minimum instead of claiming every seat
  until it caught up.
- The index: jobs stay on their RQ queue (one list per model and tier, so `rq info` shows them
  queued), and every writer that puts a job on a queue also puts its id on its owner's list of
  that queue (`Keys.queue_owner_jobs`, owners in `Keys.queue_owners`): submit_jobs, requeue,
  recovery; cancel takes it off both. A claim reads one head per owner with queued jobs (a few
  commands per owner, not per queued job: a 10,000-job burst of one key costs the same), pops the
  winner's list and LREMs the job from the RQ queue. The index is only a guide: an entry whose job
  is no longer waiting (taken or canceled outside these scripts) is dropped when met, and jobs put
  on a queue without it (a plain rq enqueue) are claimed FIFO once no indexed job is left.
- Priorities stay strict (all of high before normal before low, for any number of tiers), and the
  KV budget check applies to the picked job as it did to the queue's head.
"""

from __future__ import annotations

# What a job with no recorded max_tokens (enqueued without submit_job) is charged at its claim.
DEFAULT_CHARGE_TOKENS = 256

# [fair-share] Lua for CLAIM, placed after its `key` helper and P. Needs, after the P wake-up
# lists, KEYS weights, vtimes, clock (4+3P+1..3), then the P owners sets (Keys.queue_owners,
# 4+3P+3+qi); ARGV[28] the default charge. Defines fair_next(qi) -> job id and its owner list
# (or nil), fair_take(qi, job_id, owner_list) -> taken?, fair_forget(job_id, qi),
# fair_charge(fields, updates) and fair_save().
CLAIM_FAIR_PICK = """
-- [fair-share] begin (worker/jobs/fair_share.py): within a tier, the oldest job of the owner
-- with the lowest virtual token counter.
local FAIR_WEIGHTS, FAIR_VTIMES, FAIR_CLOCK = KEYS[4 + 3 * P + 1], KEYS[4 + 3 * P + 2],
                                              KEYS[4 + 3 * P + 3]
local fair_default_charge = tonumber(ARGV[28])
local fair_clock = tonumber(redis.call('GET', FAIR_CLOCK) or '0') or 0
local fair_clock_read = fair_clock
local fair_vt = {}  -- owner -> counter, as read or charged by this call

local function fair_vtime(owner)
  local vt = fair_vt[owner]
  if vt == nil then
    vt = tonumber(redis.call('HGET', FAIR_VTIMES, owner) or '0') or 0
    fair_vt[owner] = vt
  end
  -- Idle time banks nothing: an owner counts from the clock at least.
  return math.max(vt, fair_clock)
end

-- The first job of an owner's list that is still waiting (stale entries are dropped), with its
-- created_at; nil when none is left.
local function fair_head(list)
  while true do
    local job_id = redis.call('LINDEX', list, 0)
    if not job_id then return nil end
    local fields = redis.call('HMGET', key(13, job_id), 'status', 'created_at')
    if fields[1] == 'queued' or fields[1] == 'preempted' then
      return job_id, tonumber(fields[2] or '0') or 0
    end
    redis.call('LPOP', list)
  end
end

-- The job to claim next from tier qi and the owner list it heads ('' when taken FIFO: not
-- indexed); nil when the tier has no job. Not taken yet: the caller checks the KV budget first.
local function fair_next(qi)
  local owners = KEYS[4 + 3 * P + 3 + qi]
  local best, best_vt, best_created, best_job
  for _, owner in ipairs(redis.call('SMEMBERS', owners)) do
    local job_id, created = fair_head(owners .. ':' .. owner)  -- Keys.queue_owner_jobs
    if not job_id then
      redis.call('SREM', owners, owner)
    else
      local vt = fair_vtime(owner)
      if best == nil or vt < best_vt or (vt == best_vt and (created < best_created or
          (created == best_created and owner < best))) then
        best, best_vt, best_created, best_job = owner, vt, created, job_id
      end
    end
  end
  if best ~= nil then return best_job, owners .. ':' .. best end
  local head = redis.call('LINDEX', KEYS[4 + qi], 0)
  if head then return head, '' end
  return nil
end

-- Take the picked job off its owner list and its RQ queue; false when the queue no longer held
-- it (the caller picks again).
local function fair_take(qi, job_id, owner_list)
  if owner_list == '' then
    redis.call('LPOP', KEYS[4 + qi])
    return true
  end
  redis.call('LPOP', owner_list)
  return redis.call('LREM', KEYS[4 + qi], 1, job_id) == 1
end

-- A job an rq worker took off its queue itself (worker.rq_entry adopts it): off its owner's
-- list too.
local function fair_forget(job_id, qi)
  local owner = redis.call('HGET', key(13, job_id), 'owner') or ''
  redis.call('LREM', KEYS[4 + 3 * P + 3 + qi] .. ':' .. owner, 1, job_id)
end

-- Charge a job's owner its max_tokens / weight at its first claim (the finish settles it).
-- `fields`: the job's state hash as read; the charge goes into `updates`, the claim's one HSET
-- of that hash (field, value, ...).
local function fair_charge(fields, updates)
  if fields.fair_charge then return end
  local owner = fields.owner or ''
  local tokens = tonumber(fields.max_tokens or '') or 0
  if tokens <= 0 then tokens = fair_default_charge end
  local weight = tonumber(redis.call('HGET', FAIR_WEIGHTS, owner) or '1') or 1
  if weight <= 0 then weight = 1 end
  local vt = fair_vtime(owner)
  fair_clock = vt  -- the owner served now had the lowest counter: the clock moves up to it
  vt = vt + tokens / weight
  fair_vt[owner] = vt
  redis.call('HSET', FAIR_VTIMES, owner, string.format('%.17g', vt))
  updates[#updates + 1] = 'fair_charge'
  updates[#updates + 1] = tostring(tokens)  -- a string, as HGETALL gives the other fields
  updates[#updates + 1] = 'fair_weight'
  updates[#updates + 1] = string.format('%.17g', weight)
end

local function fair_save()
  if fair_clock ~= fair_clock_read then
    redis.call('SET', FAIR_CLOCK, string.format('%.17g', fair_clock))
  end
end
-- [fair-share] end
"""

# [fair-share] Lua for REQUEUE and RECOVER: back at the front of its owner's list too.
# `owners` is the queue's Keys.queue_owners key, `state` the job's state hash.
def requeue_to_owner_list(owners: str, state: str, job_id: str) -> str:
    """The Lua lines that put `job_id` back at the front of its owner's list (expressions)."""
    return f"""
  -- [fair-share] back at the front of its owner's list too (worker/jobs/fair_share.py).
  local fair_owner = redis.call('HGET', {state}, 'owner') or ''
  redis.call('LPUSH', {owners} .. ':' .. fair_owner, {job_id})
  redis.call('SADD', {owners}, fair_owner)
"""


def settle_owner_counter(vtimes: str, charge: str, weight: str, owner: str) -> str:
    """[fair-share] Lua for FINISH, after its lease and final-status guards: the claim charged
    max_tokens; settle the owner's counter to what was generated. `vtimes` is the KEYS
    expression of the model's Keys.fair_vtimes; `charge`, `weight` and `owner` expressions of
    the state hash's fair_charge, fair_weight and owner as FINISH read them; ARGV[7] the tokens."""
    return f"""
-- [fair-share] begin: the claim charged max_tokens; settle the owner to what was generated.
if {charge} then
  local settled = (tonumber(ARGV[7]) - tonumber({charge})) / (tonumber({weight}) or 1)
  redis.call('HINCRBYFLOAT', {vtimes}, {owner} or '', string.format('%.17g', settled))
end
-- [fair-share] end
"""
