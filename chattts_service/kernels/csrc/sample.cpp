#include "common.h"

// chatts_sample: ChatTTS's sampling rules for one step, for every (row, codebook), and the
// draw. The rules, as its logits processors apply them (and as generation.shape_logits does with
// torch's operators): logits / temperature; the repetition penalty over the row's last tokens
// of that codebook (a logit seen c times becomes l * p^c if negative, else l / p^c); top-p
// (the tokens whose higher-ranked neighbours already hold top_p of the probability are
// dropped, the first `min_keep` always kept); top-k (values below the k-th largest dropped, k
// at least `min_keep`); then the end-of-speech token forbidden where the row asks. The draw: the kept
// tokens' probabilities summed in vocabulary order, and the first whose running sum exceeds
// uniform * total, so a row's token depends on its own logits and its own uniform number only.
// Only the top k tokens are ever sorted (partially), so a step costs a few passes over the
// vocabulary instead of a full sort and a dozen operators.
// Sums run in index order (no reassociation), so a draw never depends on where its buffers
// happen to lie in memory.
__attribute__((optimize("no-associative-math"))) static int32_t sample(
    int64_t rows, int64_t width, int64_t vocabulary,
    const float* logits,        // [rows, width * vocabulary]
    const float* parameters,    // [rows, 3]: temperature, repetition penalty, 1 - top_p
    const int64_t* top_k,       // [rows]
    int64_t min_keep,           // tokens top-p and top-k always keep (ChatTTS: 3)
    const int64_t* windows,     // [rows, width, window]: recent tokens, `vocabulary` = none
    int64_t window,
    const int64_t* banned,      // [rows]: a token to forbid, or -1
    const float* uniforms,      // [rows, width], in [0, 1)
    int64_t* tokens,            // [rows, width], out
    int threads) {
    if (vocabulary <= 0 || min_keep < 1) return CHATTS_BAD_SAMPLING;
#pragma omp parallel num_threads(threads) if (rows * width * vocabulary > 16384)
    {
        std::vector<float> values(vocabulary), weights(vocabulary);
        std::vector<int32_t> order(vocabulary);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < rows * width; ++task) {
            const int64_t row = task / width;
            const float* in = logits + task * vocabulary;
            const float temperature = parameters[row * 3], penalty = parameters[row * 3 + 1];
            const float keep_below = parameters[row * 3 + 2];
            float* l = values.data();
            float* w = weights.data();
            for (int64_t v = 0; v < vocabulary; ++v) l[v] = in[v] / temperature;
            // repetition penalty: each distinct recent token once, by its count
            const int64_t* recent = windows + task * window;
            for (int64_t i = 0; i < window; ++i) {
                const int64_t token = recent[i];
                if (token < 0 || token >= vocabulary) continue;
                bool seen_before = false;
                int count = 0;
                for (int64_t j = 0; j < window; ++j) {
                    if (recent[j] != token) continue;
                    seen_before = seen_before || j < i;
                    ++count;
                }
                if (seen_before) continue;
                const float alpha = std::pow(penalty, static_cast<float>(count));
                l[token] = l[token] < 0.0f ? l[token] * alpha : l[token] / alpha;
            }
            float largest = -INFINITY;
            for (int64_t v = 0; v < vocabulary; ++v) largest = l[v] > largest ? l[v] : largest;
            int64_t chosen = 0;
            if (largest == -INFINITY) {  // nothing to draw from: the first token
                tokens[task] = chosen;
                continue;
            }
            // unnormalised probabilities, and their sum
            for (int64_t v = 0; v < vocabulary; ++v)
                w[v] = l[v] == -INFINITY ? 0.0f : exp_nonpositive(l[v] - largest);
            float total = 0.0f;
            for (int64_t v = 0; v < vocabulary; ++v) total += w[v];
            // the top k by value (ties by index), most likely first
            const int64_t k =
                std::min<int64_t>(std::max<int64_t>(top_k[row], min_keep), vocabulary);
            for (int64_t v = 0; v < vocabulary; ++v) order[v] = static_cast<int32_t>(v);
            std::partial_sort(order.begin(), order.begin() + k, order.end(),
                              [l](int32_t a, int32_t b) {
                                  return l[a] > l[b] || (l[a] == l[b] && a < b);
                              });
            // top-p: keep while the probability at and below this rank exceeds 1 - top_p
            int64_t kept = 0;
            float above = 0.0f;  // probability of the higher-ranked tokens
            while (kept < k) {
                if (kept >= min_keep && 1.0f - above <= keep_below) break;
                above += w[order[kept]] / total;
                ++kept;
            }
            const float threshold = l[order[kept - 1]];
            float mass = 0.0f;
            for (int64_t v = 0; v < vocabulary; ++v)
                if (l[v] >= threshold && v != banned[row]) mass += w[v];
            if (mass == 0.0f) {  // only the forbidden token was left: the best other one
                for (int64_t j = 0; j < k; ++j)
                    if (order[j] != banned[row]) { chosen = order[j]; break; }
                tokens[task] = chosen;
                continue;
            }
            // strictly below the total, so the walk never runs past the last kept token
            float target = uniforms[task] * mass;
            const float ceiling = mass * (1.0f - 1.0f / 8388608.0f);
            target = target < ceiling ? target : ceiling;
            float running = 0.0f;
            for (int64_t v = 0; v < vocabulary; ++v) {
                if (l[v] < threshold || v == banned[row]) continue;
                running += w[v];
                chosen = v;
                if (running > target) break;
            }
            tokens[task] = chosen;
        }
    }
    return CHATTS_OK;
}

extern "C" int32_t chatts_sample(const ChattsSampleArgs* a) {
    return sample(a->rows, a->width, a->vocabulary, a->logits, a->parameters, a->top_k,
                  a->min_keep, a->windows, a->window, a->banned, a->uniforms, a->tokens,
                  a->threads);
}
