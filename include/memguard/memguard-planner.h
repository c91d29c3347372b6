/**
 * @file memguard-planner.h
 * @brief The micro-batch planner: a pure, deterministic state machine.
 *
 * Fed at each step boundary with the batch size, the pressure level and the
 * room there is now (the live budget, mg_planner_set_budget), on each
 * out-of-memory error with the size that failed, and at each step's end
 * with the step's peak bytes (and, for calm steps, its duration), it
 * decides the micro-batch size of the next step.
 *
 * What it optimises: the step time, under the constraint that the step
 * fits. An online linear model of peak bytes against micro-batch size says
 * which sizes fit the room less the margin; the margin is learnt from the
 * model's own error on this run (twice its root-mean-square error, at
 * least opts.margin), widened by an out-of-memory error at a size the model
 * said fits, and narrowed back by steady steps. A second model, of step
 * time against the number of micro-batches (t = c + a k, with a, the cost
 * of one more micro-batch, never below 0), ranks the sizes that fit: the
 * fewest micro-batches, split evenly, and multiples of opts.align where
 * that adds no micro-batch.
 *
 * When the room falls below the planned size's predicted peak, or pressure
 * reaches HIGH, the next size is the fastest that fits, in one decision; it
 * grows to that size at once when the room rose by a quarter since the last
 * shrink, and after `grow_after` calm steps otherwise. Without a model or a
 * budget it halves on HIGH (a quarter on CRITICAL) and doubles on growth;
 * an out-of-memory error halves at least, except a grow that fails, which
 * goes back to the last size that ran. It holds on ELEVATED. A size that
 * failed is a ceiling while the room stays below a quarter above the room
 * it failed in, and for `retry_after` calm steps (doubled each time a size
 * let pass fails again: a one-off spike must not split the run for good).
 * No clocks, no I/O, no allocation, so recorded traces replay to the same
 * decisions.
 */
#ifndef MEMGUARD_PLANNER_H
#define MEMGUARD_PLANNER_H

#include <stdint.h>

#include "memguard.h"

#ifdef __cplusplus
extern "C" {
#endif

/** What a decision did to the planned size. */
typedef enum mg_plan_action {
    MG_PLAN_HOLD = 0,
    MG_PLAN_SHRINK = 1,
    MG_PLAN_GROW = 2,
} mg_plan_action_t;

/** Why; mg_plan_reason_name() gives the word telemetry uses. */
typedef enum mg_plan_reason {
    MG_PLAN_R_START = 0,    /**< first step: the starting size (shrunk at once under HIGH) */
    MG_PLAN_R_CALM,         /**< nothing to do (calm, counting towards a grow) */
    MG_PLAN_R_ELEVATED,     /**< held: pressure ELEVATED */
    MG_PLAN_R_HIGH,         /**< shrunk: pressure HIGH */
    MG_PLAN_R_CRITICAL,     /**< shrunk further: pressure CRITICAL */
    MG_PLAN_R_OOM,          /**< shrunk: an out-of-memory error in the step */
    MG_PLAN_R_AT_MIN,       /**< wanted to shrink, nothing smaller is allowed */
    MG_PLAN_R_AT_FULL,      /**< calm at the full batch: nothing to grow to */
    MG_PLAN_R_GROW,         /**< grown after enough calm steps */
    MG_PLAN_R_MODEL,        /**< growth held: predicted peak passes budget - margin */
    MG_PLAN_R_FAILED,       /**< growth held: a larger size failed recently */
    MG_PLAN_R_FIXED,        /**< fixed size: pressure does not change it */
    MG_PLAN_R_PEER,         /**< set to the size the ranks of a group agreed on */
    MG_PLAN_R_ROOM,         /**< shrunk: the room fell below the planned size's predicted peak */
    MG_PLAN_R_FITS,         /**< held under HIGH: the model says this size fits the room */
    MG_PLAN_R_ROOM_BACK,    /**< grown at once: the room rose by a quarter since the last shrink */
    MG_PLAN_R_COUNT
} mg_plan_reason_t;

/** Planner settings; mg_planner_opts_default() fills the defaults. */
typedef struct mg_planner_opts {
    uint64_t min_micro;    /**< smallest micro-batch (=1) */
    uint64_t multiple_of;  /**< micro-batches are multiples of this (=1) */
    uint64_t divisor_of;   /**< micro-batches divide this, e.g. a queue size (=0: none) */
    uint64_t budget_bytes; /**< the room: what peaks are planned against (=0: no model check) */
    double margin;         /**< the least margin: predicted peaks stay under budget*(1-margin) (=0.03) */
    double decay;          /**< weight kept by older observations per new one (=0.98) */
    uint32_t grow_after;   /**< calm step boundaries before a grow (=8) */
    uint32_t retry_after;  /**< calm step boundaries before passing a failed size (=64) */
    int fixed;             /**< 1: only OOMs change the size (=0) */
    uint64_t align;        /**< preferred multiple where it adds no micro-batch (=1: none; 8 on CUDA) */
} mg_planner_opts_t;

/** One decision, kept for telemetry. */
typedef struct mg_plan_decision {
    uint64_t step;   /**< step index the decision applies to */
    uint64_t from, to;
    int action;      /**< mg_plan_action_t */
    int reason;      /**< mg_plan_reason_t */
} mg_plan_decision_t;

/** Planner state; plain data, may be copied (a copy replays independently). */
typedef struct mg_planner {
    mg_planner_opts_t opts;
    uint64_t micro;          /**< planned size (0: the full batch, not seen yet) */
    uint64_t full;           /**< largest batch seen */
    uint64_t failed;         /**< smallest size that failed recently (0: none) */
    uint64_t failed_room;    /**< the room when it failed (0: unknown) */
    uint64_t retried;        /**< the failed size calm steps last let pass (0: none) */
    uint32_t retries;        /**< how often a size let pass failed again: the wait doubles */
    uint64_t ran;            /**< size of the last step that finished (0: none yet) */
    uint64_t ran_room;       /**< the room it ran in */
    uint64_t step;           /**< step boundaries seen */
    uint32_t calm;           /**< consecutive calm boundaries since the last change */
    uint32_t calm_since_fail;
    uint64_t ooms;           /**< out-of-memory events seen */
    uint64_t shrunk_room;    /**< the room at the last shrink (0: none since the last growth) */
    double sw, sx, sy, sxx, sxy; /**< decayed least-squares sums of (size, peak) */
    double sf, sfw;          /**< decayed sum and weight of known floors (bytes held as a step began) */
    double margin;           /**< the margin now (learnt; at least opts.margin) */
    double boost;            /**< the part of it out-of-memory errors added, decaying */
    double se, sew;          /**< decayed sum and weight of squared errors (share of the room) */
    uint64_t timed_full;     /**< the batch the time model's steps had (0: none yet) */
    double tw, tk, tt, tkk, tkt; /**< decayed least-squares sums of (micro-batches, seconds) */
    mg_plan_decision_t last;
} mg_planner_t;

/** Fill @p o with the defaults. */
MG_API void mg_planner_opts_default(mg_planner_opts_t *o);

/** EINVAL when no micro-batch size can satisfy the constraints. */
MG_API int mg_planner_opts_check(const mg_planner_opts_t *o);

/**
 * Initialise; @p micro is the starting size (0: the full batch).
 * @return 0, or EINVAL for contradictory options.
 */
MG_API int mg_planner_init(mg_planner_t *p, const mg_planner_opts_t *o, uint64_t micro);

/**
 * A step begins with @p batch samples at pressure @p level: decide, and
 * write the micro-batch size to use for this step (at most @p batch).
 * @return 0, or EINVAL for batch 0.
 */
MG_API int mg_planner_begin(mg_planner_t *p, uint64_t batch, int level, uint64_t *micro);

/**
 * The step failed out of memory at @p micro: shrink.
 * @return 0 with the size to retry at in @p next; ENOMEM when nothing
 *         smaller is allowed (the caller gives up).
 */
MG_API int mg_planner_oom(mg_planner_t *p, uint64_t micro, uint64_t *next);

/**
 * Adopt @p micro, the size the ranks of a process group agreed on (the
 * smallest of their proposals), in place of this planner's own. @p failed,
 * when not 0, is a size that ran out of memory on another rank: growth
 * treats it as one that failed here.
 * @return 0, or EINVAL for a size of 0.
 */
MG_API int mg_planner_agree(mg_planner_t *p, uint64_t micro, uint64_t failed);

/**
 * The step finished at @p micro with @p peak_bytes at its peak (0: unknown);
 * @p floor_bytes is what the same source held as the step began (0:
 * unknown). While every step seen had one size, the model is the line
 * through the floor and that size's peaks.
 */
MG_API void mg_planner_end(mg_planner_t *p, uint64_t micro, uint64_t peak_bytes,
                           uint64_t floor_bytes);

/**
 * The step of @p batch samples at @p micro took @p seconds (a calm step
 * without a redo: others are not the plan's own time). Steps of another
 * batch size restart the time model.
 */
MG_API void mg_planner_time(mg_planner_t *p, uint64_t micro, uint64_t batch, double seconds);

/**
 * Predicted seconds of a step of the largest batch seen at @p micro.
 * @return 0, or ENODATA before a timed step.
 */
MG_API int mg_planner_predict_time(const mg_planner_t *p, uint64_t micro, double *seconds);

/**
 * The learnt time model: @p per_micro, what one more micro-batch costs
 * (never below 0), and @p base, the rest of the step.
 * @return 0, or ENODATA before a timed step.
 */
MG_API int mg_planner_time_model(const mg_planner_t *p, double *base, double *per_micro);

/** Set opts.align (0 or 1: none). */
MG_API void mg_planner_set_align(mg_planner_t *p, uint64_t align);

/**
 * The room for the next decisions: @p budget_bytes (0: none) is what the
 * predicted peak must stay under, less the margin. Set before each
 * mg_planner_begin from the live budget; a fall below the planned size's
 * predicted peak shrinks at the next boundary.
 */
MG_API void mg_planner_set_budget(mg_planner_t *p, uint64_t budget_bytes);

/**
 * The fastest allowed size whose predicted peak fits the room less the
 * learnt margin (see mg_planner_set_budget): the fewest micro-batches of
 * the largest batch seen, split evenly, a multiple of opts.align where that
 * adds none.
 * @return 0 with the size in @p size (0 when not even the smallest fits),
 *         or ENODATA without a budget or a model.
 */
MG_API int mg_planner_room_fit(const mg_planner_t *p, uint64_t *size);

/**
 * Predicted peak bytes of a step at @p micro.
 * @return 0, or ENODATA with no observations yet.
 */
MG_API int mg_planner_predict(const mg_planner_t *p, uint64_t micro, uint64_t *bytes);

/**
 * Largest allowed size not above @p x (the full batch counts as allowed).
 * @return 0, or ENOENT when there is none.
 */
MG_API int mg_planner_fit(const mg_planner_t *p, uint64_t x, uint64_t *size);

/** Names for telemetry: "hold"/"shrink"/"grow", "oom"/"high"/... */
MG_API const char *mg_plan_action_name(int action);
MG_API const char *mg_plan_reason_name(int reason);

#ifdef __cplusplus
}
#endif

#endif
