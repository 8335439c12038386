/* A screened greedy step's candidates in one slice of approximate logits (greedy_screen.py):
 * approx[n, width], the error of approx[r][c] at most margin[r] * norms[c].
 *
 * Each row's floor rises to the slice's largest lower bound, approx - margin norm (a NaN one
 * left out); the slice's candidates are the tokens whose upper bound, approx + margin norm,
 * reaches the risen floor (a NaN one counts as +inf: such a token is a candidate). Two passes
 * over a row while it is in cache, where torch's elementwise ops took eight over the slice.
 * The bounds are fused multiply-adds (fmaf), so that counting and writing see the same ones.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* Raises floor[r] for each row and returns how many candidates the slice has (-1 where its
 * counts cannot be allocated). Where they fit in `capacity`, writes them in row order, column
 * order within a row: rows[i], ids[i] = start + column, upper[i] (+inf for NaN); else writes
 * none, and a call again with room writes them (the floors are already the slice's, and a
 * floor is the largest of what it has seen). */
int screen_candidates(const float *approx, int64_t n, int64_t width, const float *margin,
                      const float *norms, float *floor, int64_t start, int64_t capacity,
                      int64_t *rows, int64_t *ids, float *upper, int num_threads) {
    int64_t *first = malloc(sizeof *first * (size_t)(n + 1));
    if (!first) return -1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < n; ++r) {
        const float *a = approx + r * width, m = margin[r];
        float best = floor[r];
#pragma omp simd reduction(max : best)
        for (int64_t c = 0; c < width; ++c) {
            const float lower = fmaf(-m, norms[c], a[c]);
            best = lower > best ? lower : best;
        }
        floor[r] = best;
        int64_t count = 0;
#pragma omp simd reduction(+ : count)
        for (int64_t c = 0; c < width; ++c) count += !(fmaf(m, norms[c], a[c]) < best);
        first[r + 1] = count;
    }
    first[0] = 0;
    for (int64_t r = 0; r < n; ++r) first[r + 1] += first[r];
    const int64_t total = first[n];
    if (total <= capacity) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t r = 0; r < n; ++r) {
            const float *a = approx + r * width, m = margin[r], best = floor[r];
            int64_t i = first[r];
            for (int64_t c = 0; c < width && i < first[r + 1]; ++c) {
                const float u = fmaf(m, norms[c], a[c]);
                if (u < best) continue;
                rows[i] = r, ids[i] = start + c, upper[i] = isnan(u) ? INFINITY : u;
                ++i;
            }
        }
    }
    free(first);
    return (int)total;
}
