"""The decode loop's pieces against ChatTTS's and transformers' own implementations."""

import pytest
import torch
from ChatTTS.model.processors import gen_logits
from transformers import LlamaModel

from chattts_service.domain.speech import CODE_SAMPLING, TEXT_SAMPLING, Sampling
from chattts_service.inference.generation import (
    Batch,
    Heads,
    Sequence,
    TextSequence,
    sample,
    sample_with_kernels,
    shape_logits,
)
from chattts_service.inference.transformer import KVCache, PromptFill, Transformer
from chattts_service.kernels import bindings as cpp_kernels
from chattts_service.kernels import tuning

# the test environment has a compiler: the kernels must build and load here
CPP = cpp_kernels.load("on")


class _FakeEmbed:
    """Shapes of ChatTTS's Embed, enough for Heads; the heads' values do not matter here."""

    def __init__(self, hidden=8, audio=626, text=50):
        self.emb_code = [torch.nn.Embedding(audio, hidden) for _ in range(4)]
        self.emb_text = torch.nn.Embedding(text, hidden)
        self.head_code = [torch.nn.Linear(hidden, audio, bias=False) for _ in range(4)]
        self.head_text = torch.nn.Linear(hidden, text, bias=False)


def _upstream(sequence, logits, sampling):
    """ChatTTS's own processing of one row: temperature, then its processors in its order."""
    warpers, processors = gen_logits(
        num_code=logits.shape[-1],
        top_P=sampling.top_p,
        top_K=sampling.top_k,
        repetition_penalty=sampling.repetition_penalty,
    )
    start = max(0, sequence.steps - 16)
    history = sequence.tokens[start : sequence.steps].T
    logits = logits / sampling.temperature
    for processor in (*processors, *warpers):
        logits = processor(history, logits)
    return logits


def _sequences_of_every_rule(kind, heads):
    """Three rows: ChatTTS's own sampling, a strict and a loose one; empty, partial and full
    repetition windows."""
    samplings = [
        CODE_SAMPLING if kind == "code" else TEXT_SAMPLING,
        Sampling(temperature=0.9, top_p=0.5, top_k=5, repetition_penalty=1.3),
        Sampling(temperature=0.1, top_p=0.95, top_k=50, repetition_penalty=1.0),
    ]
    cls = Sequence if kind == "code" else TextSequence
    vocabulary = 626 if kind == "code" else 50
    sequences = []
    for index, sampling in enumerate(samplings):
        sequence = cls(
            torch.zeros(3, 8),
            heads,
            sampling,
            seed=index,
            max_steps=64,
            min_steps=0,
            eos_token=vocabulary - 1,
        )
        steps = [0, 5, 40][index]  # empty, partial and full repetition windows
        sequence.tokens[:steps] = torch.randint(0, 30, (steps, sequence.width))
        sequence.steps = steps
        sequences.append(sequence)
    return sequences, samplings, vocabulary


@pytest.mark.parametrize("kind", ["code", "text"])
def test_vectorised_sampling_rules_match_chattts_processors(kind):
    torch.manual_seed(0)
    sequences, samplings, vocabulary = _sequences_of_every_rule(kind, Heads(_FakeEmbed(), rows=4))
    logits = torch.randn(len(sequences), sequences[0].width * vocabulary) * 3
    mine = shape_logits(sequences, logits.clone())
    for row, (sequence, sampling) in enumerate(zip(sequences, samplings)):
        expected = _upstream(sequence, logits[row].view(sequence.width, vocabulary), sampling)
        assert torch.equal(torch.isinf(mine[row]), torch.isinf(expected)), row
        finite = ~torch.isinf(expected)
        assert torch.allclose(mine[row][finite], expected[finite], rtol=1e-6, atol=1e-6), row


@pytest.mark.parametrize("kind", ["code", "text"])
@pytest.mark.parametrize("banned", [False, True])
def test_kernel_sampler_draws_what_the_rules_allow_in_their_proportions(kind, banned):
    """The C++ sampler against torch's rules (``shape_logits``) and draw: a uniform number in
    the middle of a token's share of the cumulative probability (tokens in vocabulary order)
    must draw that token, for every token the rules keep; so it keeps the same tokens with
    the same probabilities, and never draws one they drop."""
    torch.manual_seed(2)
    heads = Heads(_FakeEmbed(), rows=4, kernels=CPP)
    sequences, _, vocabulary = _sequences_of_every_rule(kind, heads)
    if banned:  # end of speech forbidden (min_steps), and made the likeliest token
        for sequence in sequences:
            sequence.min_steps = sequence.steps + 1
    logits = torch.randn(len(sequences), sequences[0].width * vocabulary) * 3
    if banned:
        logits.view(len(sequences), -1, vocabulary)[..., vocabulary - 1] = 20.0
    probabilities = torch.softmax(shape_logits(sequences, logits.clone()), dim=-1).double()
    cumulative = probabilities.cumsum(dim=-1)
    width = sequences[0].width
    checked = torch.zeros(len(sequences), width, dtype=torch.long)
    for token in range(vocabulary):
        share = probabilities[..., token]  # [rows, width]
        middle = (cumulative[..., token] - share / 2) / cumulative[..., -1]
        drawn = sample_with_kernels(CPP, sequences, logits, middle.float().contiguous())
        wanted = share > 1e-4  # clear of rounding at the edges of a share
        assert torch.equal(drawn[wanted], torch.full_like(drawn[wanted], token)), token
        # and whatever it drew, the rules keep it
        kept = probabilities.gather(-1, drawn[..., None])[..., 0] > 0
        assert bool(kept.all()), token
        checked += wanted
    assert bool((checked >= 1).all()), checked  # every row and codebook was put to the test
    if banned:
        assert not bool((sample(sequences, logits) == vocabulary - 1).any())


def test_min_steps_forbid_end_of_speech():
    heads = Heads(_FakeEmbed(), rows=2)
    sequence = Sequence(
        torch.zeros(3, 8), heads, CODE_SAMPLING, seed=1, max_steps=8, min_steps=2, eos_token=625
    )
    logits = torch.zeros(1, 4 * 626)
    logits.view(4, 626)[:, 625] = 100.0  # end-of-speech is by far the likeliest
    assert torch.isinf(shape_logits([sequence], logits)[0, :, 625]).all()
    sequence.steps = 2
    assert not torch.isinf(shape_logits([sequence], logits)[0, :, 625]).any()


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_heads_give_each_row_the_same_logits_whatever_the_batch(quantization):
    torch.manual_seed(3)
    heads = Heads(_FakeEmbed(hidden=64), rows=8, quantization=quantization)
    hiddens = torch.randn(8, 64)
    together = heads.logits(hiddens, "code")
    for row in range(8):
        assert torch.equal(heads.logits(hiddens[row : row + 1], "code")[0], together[row])


@pytest.mark.parametrize(
    "quantization, kernels",
    [("none", "on"), ("none", "off"), ("int8", "on"), ("int8", "off"), ("int4", "on")],
)
def test_lean_transformer_matches_transformers_llama(tiny_model_dir, quantization, kernels):
    llama = LlamaModel.from_pretrained(str(tiny_model_dir / "asset/gpt"))
    torch.manual_seed(0)
    hidden = llama.config.hidden_size
    prompt, steps = torch.randn(12, hidden), torch.randn(4, hidden)
    with torch.no_grad():
        reference = llama(
            inputs_embeds=torch.cat([prompt, steps])[None], use_cache=False
        ).last_hidden_state[0]
    lean = Transformer(llama, quantization, kernels)
    cache = lean.new_cache()
    outputs = [lean.prefill(prompt, cache)]
    for index in range(4):
        outputs.append(lean.step(steps[index : index + 1], [cache], [12 + index])[0])
    # fp32 throughout: rounding only; the kernels keep the KV cache in bf16 (full-size model:
    # ~6e-4 relative); int8 and int4 products: quantisation error
    tolerance = {"int8": 0.05, "int4": 0.05}.get(quantization, 1e-3 if kernels == "on" else 1e-5)
    for position, output in zip(range(11, 16), outputs):
        error = (output - reference[position]).norm() / reference[position].norm()
        assert error < tolerance, (position, float(error))


@pytest.mark.parametrize("quantization, kernels", [("int8", "on"), ("int8", "off"), ("int4", "on")])
def test_quantized_rows_are_exactly_independent_of_their_batch(
    tiny_model_dir, quantization, kernels
):
    llama = LlamaModel.from_pretrained(str(tiny_model_dir / "asset/gpt"))
    torch.manual_seed(1)
    hidden = llama.config.hidden_size
    model = Transformer(llama, quantization, kernels)
    prompt = torch.randn(9, hidden)
    caches = [model.new_cache() for _ in range(4)]
    model.prefill(prompt, caches[0])
    model.prefill(prompt, caches[1])
    model.prefill(torch.randn(30, hidden) * 8, caches[2])  # a longer, louder neighbour
    model.prefill(torch.randn(2, hidden) * 0.1, caches[3])  # and a short, quiet one
    step = torch.randn(hidden)
    mine = model.step(step[None], [caches[0]], [9])[0]
    theirs = model.step(
        torch.stack([step, torch.randn(hidden), torch.randn(hidden)]), caches[1:], [9, 30, 2]
    )[0]
    assert torch.equal(mine, theirs)


def _int8_products():
    return ["avx2", "vnni"] if cpp_kernels.cpu_supports(cpp_kernels.VNNI_CPU_FLAGS) else ["avx2"]


@pytest.mark.parametrize(
    "quantization, product", [("int8", p) for p in _int8_products()] + [("int4", "auto")]
)
@pytest.mark.parametrize("kv_cache", ["bf16", "int8"])
def test_one_call_through_every_layer_gives_the_layer_by_layer_bits(
    tiny_model_dir, quantization, product, kv_cache
):
    llama = LlamaModel.from_pretrained(str(tiny_model_dir / "asset/gpt"))
    torch.manual_seed(2)
    hidden = llama.config.hidden_size
    model = Transformer(llama, quantization, "on", product, kv_cache)
    expected = "int4" if quantization == "int4" else product
    assert model.decode_layers is not None and model.linear_kernel == expected
    lengths = [9, 30, 0, 4]
    pairs = []
    for length in lengths:
        prompt = torch.randn(length, hidden) * 4
        caches = (model.new_cache(reserve=40), model.new_cache(reserve=40))
        if length:
            for cache in caches:
                model.prefill(prompt, cache)
        pairs.append(caches)
    steps = torch.randn(len(lengths), hidden)
    gathered = model.decode_layers
    for position in range(3):  # three steps: each reads what the one before wrote
        positions = [length + position for length in lengths]
        model.decode_layers = gathered
        fused = model.step(steps, [pair[0] for pair in pairs], positions)
        model.decode_layers = None
        layered = model.step(steps, [pair[1] for pair in pairs], positions)
        assert torch.equal(fused, layered)
        steps = fused
    for (first, second), length in zip(pairs, lengths):
        held = length + 3
        names = ["keys", "values"] + (["key_scales", "value_scales"] if kv_cache == "int8" else [])
        for name in names:
            assert torch.equal(
                getattr(first, name)[:, :, :held], getattr(second, name)[:, :, :held]
            ), name


@pytest.mark.parametrize("quantization, tiles", [("int8", False), ("int4", False), ("int8", True)])
@pytest.mark.parametrize("kv_cache", ["bf16", "int8"])
def test_a_prompt_in_one_call_gives_the_bits_of_its_tokens_stepped_one_by_one(
    tiny_model_dir, quantization, tiles, kv_cache
):
    """The kernels' prefill (the prompt's positions as the rows of one call) stores every key
    and value, and ends on the hidden state, that decode steps over the same tokens one at a
    time give. With tiles from 2 rows, the prompt's 37 rows run on AMX tiles (three passes of
    16, the last padded) and each step's one row on VNNI: the same bits."""
    llama = LlamaModel.from_pretrained(str(tiny_model_dir / "asset/gpt"))
    torch.manual_seed(5)
    hidden = llama.config.hidden_size
    model = Transformer(llama, quantization, "on", kv_cache=kv_cache)
    length = 13
    if tiles:
        if not model.kernels.has_tiles:
            pytest.skip("no AMX tiles here (the CPU lacks AMX-INT8, or the OS grants none)")
        model.kernels.tuning = tuning.KernelTuning(16, "nta", 2, 2).to_abi()
        length = 37
    prompt = torch.randn(length, hidden) * 4
    together, alone = model.new_cache(reserve=40), model.new_cache(reserve=40)
    last = model.prefill(prompt, together)
    for position in range(len(prompt)):
        stepped = model.step(prompt[position : position + 1], [alone], [position])[0]
    assert torch.equal(last, stepped)
    names = ["keys", "values"] + (["key_scales", "value_scales"] if kv_cache == "int8" else [])
    for name in names:
        assert torch.equal(getattr(together, name)[:, :, :13], getattr(alone, name)[:, :, :13])


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_step_drawn_in_one_call_gives_the_separate_calls_tokens(tiny_model_dir, quantization):
    """The layers, the final norm, the code head and the draw in one C++ call: each row's
    hidden states and tokens are those of the calls one after the other, step after step, for
    rows of different prompts, samplings, repetition windows and forbidden end of speech."""
    llama = LlamaModel.from_pretrained(str(tiny_model_dir / "asset/gpt"))
    torch.manual_seed(4)
    hidden = llama.config.hidden_size
    model = Transformer(llama, quantization, "on")
    heads = Heads(_FakeEmbed(hidden=hidden), rows=4, quantization="int8", kernels=CPP)
    samplings = [
        CODE_SAMPLING,
        Sampling(temperature=0.9, top_p=0.5, top_k=5, repetition_penalty=1.3),
        Sampling(temperature=1.5, top_p=0.95, top_k=50, repetition_penalty=1.0),
    ]
    prompts = [torch.randn(length, hidden) * 4 for length in (7, 19, 3)]

    def batch():
        made = Batch(model, heads, 4)
        for index, (prompt, sampling) in enumerate(zip(prompts, samplings)):
            made.add(Sequence(prompt, heads, sampling, index, 40, min_steps=25, eos_token=625))
        return made, list(made.active)

    (one_call, ones), (separate, others) = batch(), batch()
    assert one_call._one_call_head() is heads.code_head.packing
    separate._one_call_head = lambda: None  # the layers, then the head and the draw apart
    while one_call.active or separate.active:
        one_call.step()
        separate.step()
    for mine, theirs in zip(ones, others):
        assert mine.steps == theirs.steps >= 25  # end of speech forbidden before 25 steps
        assert torch.equal(mine.result_tokens(), theirs.result_tokens())
        assert torch.equal(mine.result_hiddens(), theirs.result_hiddens())
    # the one call refuses what is not an int8 head as wide as the layers' rows
    with pytest.raises(ValueError, match="int8 packing"):
        model.step_and_draw(torch.randn(1, hidden), [model.new_cache(8)], [0], None, ())


def test_the_gathered_layers_refuse_what_does_not_fit(tiny_model_dir):
    llama = LlamaModel.from_pretrained(str(tiny_model_dir / "asset/gpt"))
    model = Transformer(llama, "int8", "on")
    hidden = llama.config.hidden_size
    cache = model.new_cache(reserve=8)
    rows = cpp_kernels.StepRows([cache], [0])
    with pytest.raises(ValueError, match="contiguous float32"):
        model.decode_layers(torch.randn(1, hidden, dtype=torch.float64), rows)
    with pytest.raises(ValueError, match="one cache per row"):
        model.decode_layers(torch.randn(2, hidden), rows)
    other = KVCache(len(model.layers) + 1, model.heads, model.head_dim, 8, torch.bfloat16)
    with pytest.raises(ValueError, match="another shape"):
        model.decode_layers(torch.randn(1, hidden), cpp_kernels.StepRows([other], [0]))
    with pytest.raises(ValueError, match="beyond the rotary"):
        model.decode_layers(
            torch.randn(1, hidden), cpp_kernels.StepRows([cache], [model.max_positions])
        )
    # without the kernels' products everywhere there is nothing to gather: one call per layer
    assert Transformer(llama, "none", "on").decode_layers is None
    assert Transformer(llama, "int8", "off").decode_layers is None
    with pytest.raises(ValueError, match="int4 needs the C"):
        Transformer(llama, "int4", "off")


@pytest.mark.parametrize("kernels", [None, CPP], ids=["torch", "kernels"])
def test_sampling_follows_the_distribution_and_never_draws_a_masked_token(kernels):
    heads = Heads(_FakeEmbed(), rows=1, kernels=kernels)
    sampling = Sampling(temperature=1.0, top_p=1.0, top_k=626, repetition_penalty=1.0)
    sequence = Sequence(
        torch.zeros(3, 8), heads, sampling, seed=5, max_steps=8, min_steps=0, eos_token=625
    )
    logits = torch.full((1, 4 * 626), -torch.inf)
    chosen = torch.tensor([3, 10, 11, 624])
    wanted = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits.view(4, 626)[:, chosen] = wanted.log()
    draws = torch.stack([sample([sequence], logits)[0] for _ in range(4000)])  # [4000, 4]
    assert set(draws.unique().tolist()) <= set(chosen.tolist())
    frequencies = torch.stack([(draws == token).float().mean() for token in chosen])
    # 4 x 4000 draws: the standard error of each frequency is below 0.004
    assert torch.allclose(frequencies, wanted, atol=0.02), frequencies
    # the row's own generator decides: the same seed draws the same tokens
    again = Sequence(
        torch.zeros(3, 8), heads, sampling, seed=5, max_steps=8, min_steps=0, eos_token=625
    )
    assert torch.equal(sample([again], logits)[0], draws[0])


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("kv_cache", ["bf16", "int8"])
def test_a_kept_prompt_beginning_gives_the_bits_of_the_whole_prompt(
    tiny_model_dir, quantization, kv_cache
):
    """Prompts that begin with the same embeddings: the first computes the whole prompt and
    keeps its beginning's keys and values, the next copy them and compute the rest; every one
    ends on the hidden state, and holds the cache, of its whole prompt computed alone."""
    llama = LlamaModel.from_pretrained(str(tiny_model_dir / "asset/gpt"))
    torch.manual_seed(6)
    hidden = llama.config.hidden_size
    model = Transformer(llama, quantization, "on", kv_cache=kv_cache)
    beginning = torch.randn(3, hidden) * 4
    names = ["keys", "values"] + (["key_scales", "value_scales"] if kv_cache == "int8" else [])
    for rest in (10, 4, 1):
        prompt = torch.cat([beginning, torch.randn(rest, hidden) * 4])
        kept, whole = model.new_cache(reserve=16), model.new_cache(reserve=16)
        assert torch.equal(model.prefill(prompt, kept, shared=3), model.prefill(prompt, whole))
        for name in names:
            held = len(prompt)
            assert torch.equal(getattr(kept, name)[:, :, :held], getattr(whole, name)[:, :, :held])
    assert (model.prefixes.misses, model.prefixes.hits, len(model.prefixes)) == (1, 2, 1)
    # another beginning (another voice) is kept beside it, up to the store's size
    model.prefixes.entries = 2
    for _ in range(3):
        model.prefill(torch.randn(6, hidden), model.new_cache(reserve=8), shared=3)
    assert len(model.prefixes) == 2 and model.prefixes.misses == 4
    # a prompt no longer than its shared beginning is computed whole and not kept
    model.prefill(beginning, model.new_cache(reserve=8), shared=3)
    assert model.prefixes.misses == 4


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("kv_cache", ["bf16", "int8"])
def test_a_prompt_prefilled_in_pieces_gives_the_bits_of_the_whole_prompt(
    tiny_model_dir, quantization, kv_cache
):
    """The scheduler prefills a long prompt a few positions at a time between steps: every
    piece size ends on the hidden state, and holds the cache, of the prompt in one call, with
    and without a kept beginning (computed by a piece, then copied)."""
    llama = LlamaModel.from_pretrained(str(tiny_model_dir / "asset/gpt"))
    torch.manual_seed(9)
    hidden = llama.config.hidden_size
    model = Transformer(llama, quantization, "on", kv_cache=kv_cache)
    assert model.prefills_in_pieces
    names = ["keys", "values"] + (["key_scales", "value_scales"] if kv_cache == "int8" else [])
    beginning = torch.randn(3, hidden) * 4
    prompt = torch.cat([beginning, torch.randn(20, hidden) * 4])
    whole = model.new_cache(reserve=32)
    expected = model.prefill(prompt, whole)
    model.prefixes.clear()
    for piece, shared in ((1, 0), (2, 3), (7, 3), (7, 3), (22, 0), (40, 0)):
        cache = model.new_cache(reserve=32)
        kept_before = len(model.prefixes)
        fill = PromptFill(model, prompt, cache, shared)
        copied = fill.done  # a kept beginning, copied rather than computed
        assert copied == (3 if shared and kept_before else 0)
        pieces, last = 0, None
        while last is None:
            before = fill.done
            last = fill.run(piece)
            assert fill.done - before <= piece  # never more than it was allowed
            pieces += 1
        assert pieces == -(-(len(prompt) - copied) // piece)
        assert torch.equal(last, expected), (piece, shared)
        for name in names:
            held = len(prompt)
            assert torch.equal(getattr(cache, name)[:, :, :held], getattr(whole, name)[:, :, :held])
    # the first prompt with a shared beginning kept it from its pieces; the next two copied it
    assert (model.prefixes.misses, model.prefixes.hits) == (1, 2)


def test_a_paused_sequence_resumes_with_the_samples_it_would_have_drawn(tiny_model_dir):
    """A row taken back from a sequence (``Batch.pause``) and given back later (``resume``)
    changes nothing it draws: its cache and generator wait with it."""
    llama = LlamaModel.from_pretrained(str(tiny_model_dir / "asset/gpt"))
    hidden = llama.config.hidden_size
    model = Transformer(llama, "int8", "on")
    heads = Heads(_FakeEmbed(hidden=hidden), rows=4, quantization="int8", kernels=CPP)
    torch.manual_seed(3)
    prompts = [torch.randn(5, hidden), torch.randn(9, hidden)]

    def run(pause_at: int | None) -> list[torch.Tensor]:
        batch = Batch(model, heads, 4)
        sequences = [
            Sequence(prompt, heads, CODE_SAMPLING, seed, 24, 24, eos_token=625)
            for seed, prompt in enumerate(prompts)
        ]
        for sequence in sequences:
            batch.add(sequence)
        for step in range(30):
            if step == pause_at:
                batch.pause(sequences[1])
            if pause_at is not None and step == pause_at + 5:
                batch.resume(sequences[1])
            batch.step()
        return [sequence.result_tokens() for sequence in sequences]

    straight, paused = run(None), run(4)
    for one, other in zip(straight, paused, strict=True):
        assert len(one) == 24 and torch.equal(one, other)
