/* llama.cpp's next-token logits after every token of a prompt, through its public C API
 * (tests/support/arch_fixtures.py compiles and runs it: the reference its tests hold chatkv to).
 *
 *     llama_logits MODEL.gguf OUT.f32 ID...
 *
 * Writes float32 [n_ids, n_vocab] to OUT.f32, row i the logits after ids[0..i]. */
#include <stdio.h>
#include <stdlib.h>

#include "llama.h"

int main(int argc, char ** argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s MODEL.gguf OUT.f32 ID...\n", argv[0]);
        return 2;
    }
    const int n = argc - 3;
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    /* no repacked weight buffers: ggml's AMX path crashes on some CPUs that report AMX; the
     * plain CPU kernels compute the same model */
    mp.use_extra_bufts = false;
    struct llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 128;
    cp.n_batch = 128;
    cp.n_ubatch = 128;
    cp.n_threads = 2;
    cp.n_threads_batch = 2;
    struct llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "cannot make a context\n");
        return 1;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    struct llama_batch batch = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        batch.token[i] = atoi(argv[3 + i]);
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = n;
    if (llama_decode(ctx, batch) != 0) {
        fprintf(stderr, "decode failed\n");
        return 1;
    }
    FILE * out = fopen(argv[2], "wb");
    for (int i = 0; i < n; i++) {
        fwrite(llama_get_logits_ith(ctx, i), sizeof(float), n_vocab, out);
    }
    fclose(out);
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
