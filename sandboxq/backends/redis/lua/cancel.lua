-- cancel.lua: cancel a job that has not finished, and tell its owner at once.
-- KEYS: the standard list (common.lua).
-- ARGV: 1-4 standard; 5 job id, 6 cancel channel (PUBLISH target).
-- Returns: 1 cancelled, 0 unknown or already finished.
-- Upholds: design invariant 1 (the lease is revoked: owner and token cleared, so the owner's
-- renewals and acks are rejected and it fences itself); the PUBLISH ("<token> <id>", sent
-- when a lease was held: no worker has anything to stop otherwise) lets the owner kill
-- that attempt's child within milliseconds, and never a later attempt of the same job. A cancelled active job keeps
-- a fence (fence_owner, fence_token, fenced_until_ms = the old lease's expiry): a retry
-- cannot make it claimable until the owner confirms the child dead (confirm_dead.lua) or
-- that expiry passes. The cancelled attempt is recorded in the history.
-- Cancelled jobs are trimmed like failed ones.

return cancel_job(ARGV[5], ARGV[6])
