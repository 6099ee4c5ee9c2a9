"""Fair shares between API keys: the Lua the claim script (job_scripts.CLAIM) uses to choose,
within one priority tier, whose job boards next, and the finish script's settlement.

The design, and why:
- Where: in the claim, the one atomic script every worker of a model runs to take jobs, so the
  choice is fleet-wide (all workers read and charge the same counters) and a crash never loses a
  job (the pick, the LREM off the RQ queue and the claim bookkeeping are one script).
- What: each owner (API key id, `JobSpec.owner`) has a virtual token counter per model
  (`Keys.fair_vtimes`): tokens charged / the key's weight (`Keys.fair_weights`, written by the
  API from its settings). Within a tier the claim serves the owner with the lowest counter,
  taking that owner's oldest queued job; ties go to the owner whose oldest job queued first,
  so a lone owner (or equal counters) keeps plain FIFO order. Over time every competing owner's
  counter advances at the same rate, so the tokens each generates are in proportion to its
  weight: weighted fair queueing, with tokens as the unit of work.
- When charged: at the claim, the job's max_tokens (recorded in its JobState), corrected to the
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
- Queue layout unchanged: jobs stay in the RQ queues (one list per model and tier), so `rq info`
  shows them queued and enqueue, requeue, recovery and cancel need no change. The price is a scan:
  a claim reads the owner of the first `scan_window` jobs of each tier it visits (one HGET each,
  once per claim call, not per token); an owner whose jobs all queue behind the window waits until
  the window reaches them (FIFO among owners past it). The LREM of a picked job is O(its position).
- Priorities stay strict (all of high before normal before low, for any number of tiers), and the
  KV budget check applies to the picked job as it did to the queue's head.
"""

from __future__ import annotations

# How many queued jobs of a tier one claim looks at to find their owners.
DEFAULT_SCAN_WINDOW = 256
# What a job with no recorded max_tokens (enqueued without submit_job) is charged at its claim.
DEFAULT_CHARGE_TOKENS = 256

# [fair-share] Lua for CLAIM, placed after its `key` helper and P. Needs, after the P wake-up
# lists, KEYS weights, vtimes, clock (4+3P+1..3); ARGV[28] the scan window, ARGV[29] the default
# charge. Defines fair_next(qi) -> job id or nil, fair_take(qi, job_id), fair_charge(state) and
# fair_save().
CLAIM_FAIR_PICK = """
-- [fair-share] begin (worker/jobs/fair_share.py): within a tier, the oldest job of the owner
-- with the lowest virtual token counter.
local FAIR_WEIGHTS, FAIR_VTIMES, FAIR_CLOCK = KEYS[4 + 3 * P + 1], KEYS[4 + 3 * P + 2],
                                              KEYS[4 + 3 * P + 3]
local fair_window = tonumber(ARGV[28])
local fair_default_charge = tonumber(ARGV[29])
local fair_clock = tonumber(redis.call('GET', FAIR_CLOCK) or '0') or 0
local fair_clock_read = fair_clock
local fair_vt = {}  -- owner -> counter, as read or charged by this call
local fair_tiers = {}  -- tier -> its scanned window: owners, their jobs (id, position), next index

local function fair_vtime(owner)
  local vt = fair_vt[owner]
  if vt == nil then
    vt = tonumber(redis.call('HGET', FAIR_VTIMES, owner) or '0') or 0
    fair_vt[owner] = vt
  end
  -- Idle time banks nothing: an owner counts from the clock at least.
  return math.max(vt, fair_clock)
end

local function fair_scan(qi)
  local tier = {owners = {}, jobs = {}, next = {}}
  local ids = redis.call('LRANGE', KEYS[4 + qi], 0, fair_window - 1)
  for position, id in ipairs(ids) do
    local owner = redis.call('HGET', key(13, id), 'owner') or ''
    if tier.jobs[owner] == nil then
      tier.jobs[owner] = {}
      tier.next[owner] = 1
      tier.owners[#tier.owners + 1] = owner
    end
    local list = tier.jobs[owner]
    list[#list + 1] = {id, position}
  end
  return tier
end

-- The job to claim next from tier qi (nil: the tier is empty). It is not taken yet: the caller
-- checks the KV budget, then calls fair_take(qi, job_id).
local function fair_next(qi)
  for _ = 1, 2 do
    local tier = fair_tiers[qi]
    if tier == nil then
      tier = fair_scan(qi)
      fair_tiers[qi] = tier
    end
    local best, best_vt, best_position
    for _, owner in ipairs(tier.owners) do
      local job = tier.jobs[owner][tier.next[owner]]
      if job ~= nil then
        local vt = fair_vtime(owner)
        if best == nil or vt < best_vt or (vt == best_vt and job[2] < best_position) then
          best, best_vt, best_position = owner, vt, job[2]
        end
      end
    end
    if best ~= nil then
      tier.picked = best
      return tier.jobs[best][tier.next[best]][1]
    end
    if #tier.owners == 0 then return nil end
    fair_tiers[qi] = nil  -- the window is used up: scan the queue again past it
  end
  return nil
end

local function fair_take(qi, job_id)
  local tier = fair_tiers[qi]
  tier.next[tier.picked] = tier.next[tier.picked] + 1
  redis.call('LREM', KEYS[4 + qi], 1, job_id)
end

-- Charge a job's owner its max_tokens / weight at its first claim (the finish settles it).
local function fair_charge(state)
  if redis.call('HEXISTS', state, 'fair_charge') == 1 then return end
  local fields = redis.call('HMGET', state, 'owner', 'max_tokens')
  local owner = fields[1] or ''
  local tokens = tonumber(fields[2] or '') or 0
  if tokens <= 0 then tokens = fair_default_charge end
  local weight = tonumber(redis.call('HGET', FAIR_WEIGHTS, owner) or '1') or 1
  if weight <= 0 then weight = 1 end
  local vt = fair_vtime(owner)
  fair_clock = vt  -- the owner served now had the lowest counter: the clock moves up to it
  vt = vt + tokens / weight
  fair_vt[owner] = vt
  redis.call('HSET', FAIR_VTIMES, owner, string.format('%.17g', vt))
  redis.call('HSET', state, 'fair_charge', tokens, 'fair_weight', string.format('%.17g', weight))
end

local function fair_save()
  if fair_clock ~= fair_clock_read then
    redis.call('SET', FAIR_CLOCK, string.format('%.17g', fair_clock))
  end
end
-- [fair-share] end
"""

# [fair-share] Lua for FINISH: KEYS[17] is the model's vtimes hash; the state hash is KEYS[4]
# and ARGV[7] the tokens generated. Placed after the lease and final-status guards.
FINISH_FAIR_SETTLE = """
-- [fair-share] begin: the claim charged max_tokens; settle the owner to what was generated.
local fair = redis.call('HMGET', KEYS[4], 'fair_charge', 'fair_weight', 'owner')
if fair[1] then
  local settled = (tonumber(ARGV[7]) - tonumber(fair[1])) / (tonumber(fair[2]) or 1)
  redis.call('HINCRBYFLOAT', KEYS[17], fair[3] or '', string.format('%.17g', settled))
end
-- [fair-share] end
"""
