// A Llama-family decoder stack's decode step in one call on CPU: the embedding, every layer and
// the final norm, through the same kernels the Python forward calls, in the same order.
//
// A decode step of a small model is some 400 kernel calls of a few microseconds' work each; from
// Python every one of them also pays a module call, a torch.ops dispatch and the allocation of its
// output (on SmolLM2-135M at 16 rows: ~3 ms of a ~22 ms step). Here the calls are made from C++:
// the same kernels (helexa_kernels/cpu_ops.h) and the same oneDNN linear, so the result is the Python
// forward's, bit for bit (tests/engine/test_cpu_decode_stack.py).
//
// It serves steps whose every query row goes through the decode kernel (decodes, and the rows of
// short chunk continuations); engine/cpu/cpu_decode_stack.py builds it from a loaded model and decides
// which steps it serves. Registered as torch.classes.helexa_cpu.DecoderStack and .CpuLinear.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <utility>
#include <vector>

#include "../cpu_ops.h"

namespace {

// A kernel called straight, under its op's name for torch.profiler (bench/step_profile.py splits
// a step's time by op): without a profiler running, the record is one check.
template <typename Kernel, typename... Args>
void traced(const char* name, Kernel kernel, Args&&... args) {
  RECORD_FUNCTION(name, c10::ArrayRef<const c10::IValue>{});
  kernel(std::forward<Args>(args)...);
}

// oneDNN's linear from its prepacked weight (engine/cpu/cpu_linear.packed_linear), boxed: its C++
// signature is ATen's own business.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias, std::string("none"), c10::List<c10::optional<at::Scalar>>(),
                          c10::IValue()};
  op.callBoxed(&stack);
  return std::move(stack[0]).toTensor();
}

}  // namespace

// One linear layer as engine/cpu/cpu_linear.PackedWeight runs it: the bf16 kernel's packed weight for
// inputs of up to `kernel_elements` elements, oneDNN's prepacked weight otherwise.
struct CpuLinear : torch::CustomClassHolder {
  at::Tensor onednn;
  c10::optional<at::Tensor> bias;
  c10::optional<at::Tensor> kernel_weight;
  c10::optional<at::Tensor> kernel_bias;  // fp32
  int64_t kernel_elements;
  int64_t out_features;

  CpuLinear(at::Tensor onednn, c10::optional<at::Tensor> bias, c10::optional<at::Tensor> kernel_weight,
            c10::optional<at::Tensor> kernel_bias, int64_t kernel_elements, int64_t out_features)
      : onednn(std::move(onednn)), bias(std::move(bias)), kernel_weight(std::move(kernel_weight)),
        kernel_bias(std::move(kernel_bias)), kernel_elements(kernel_elements), out_features(out_features) {}

  at::Tensor operator()(const at::Tensor& x) const {
    if (kernel_weight.has_value() && x.scalar_type() == at::kBFloat16 && x.numel() <= kernel_elements) {
      at::Tensor out = at::empty({x.size(0), out_features}, x.options());
      traced("helexa_cpu::bf16_linear", helexa_cpu::bf16_linear, out, x, *kernel_weight, kernel_bias);
      return out;
    }
    return onednn_linear(x, onednn, bias);
  }
};

struct DecoderLayer {
  at::Tensor input_norm, post_attention_norm;
  c10::optional<at::Tensor> q_norm, k_norm;  // Qwen3: each query and key head normed before RoPE
  c10::intrusive_ptr<CpuLinear> qkv, o, gate_up, down;
  at::Tensor k_cache, v_cache;
};

class DecoderStack : public torch::CustomClassHolder {
 public:
  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
               at::Tensor embedding, at::Tensor final_norm, at::Tensor cos_sin)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale),
        embedding_(std::move(embedding)), final_norm_(std::move(final_norm)), cos_sin_(std::move(cos_sin)) {}

  void add_layer(at::Tensor input_norm, at::Tensor post_attention_norm, c10::optional<at::Tensor> q_norm,
                 c10::optional<at::Tensor> k_norm, c10::intrusive_ptr<CpuLinear> qkv,
                 c10::intrusive_ptr<CpuLinear> o, c10::intrusive_ptr<CpuLinear> gate_up,
                 c10::intrusive_ptr<CpuLinear> down, at::Tensor k_cache, at::Tensor v_cache) {
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm: both or neither");
    TORCH_CHECK(qkv->out_features == (num_heads_ + 2 * num_kv_heads_) * head_dim_,
                "qkv: ", qkv->out_features, " outputs, the heads need ",
                (num_heads_ + 2 * num_kv_heads_) * head_dim_);
    layers_.push_back(DecoderLayer{std::move(input_norm), std::move(post_attention_norm), std::move(q_norm),
                                   std::move(k_norm), std::move(qkv), std::move(o), std::move(gate_up),
                                   std::move(down), std::move(k_cache), std::move(v_cache)});
  }

  // input_ids, positions, slot_mapping [tokens] int64; the decode kernel's rows
  // (engine/runner/attention_plan.KernelRows) -> the final norm's output [tokens, hidden].
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& slot_mapping,
                     const at::Tensor& block_tables, const at::Tensor& key_lens, const at::Tensor& token_rows,
                     const at::Tensor& seq_rows) const {
    TORCH_CHECK(!layers_.empty(), "DecoderStack: no layers");
    at::Tensor hidden = at::embedding(embedding_, input_ids);
    const int64_t tokens = hidden.size(0);
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    // The residual stream is fp32 whatever the model dtype (engine.models.layers.residual_stream).
    at::Tensor residual = hidden.to(at::kFloat);
    at::Tensor normed = at::empty_like(hidden);
    traced("helexa_cpu::rms_norm", helexa_cpu::rms_norm, normed, hidden, layers_[0].input_norm, eps_,
           false);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const DecoderLayer& layer = layers_[i];
      if (i > 0) {
        normed = at::empty_like(hidden);
        traced("helexa_cpu::fused_add_rms_norm", helexa_cpu::fused_add_rms_norm, normed, hidden, residual,
               layer.input_norm, eps_, false);
      }
      at::Tensor qkv = (*layer.qkv)(normed);
      at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads_, head_dim_});
      at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads_, head_dim_});
      at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads_, head_dim_});
      if (layer.q_norm.has_value()) {
        q = norm_heads(q, *layer.q_norm);
        k = norm_heads(k, *layer.k_norm);
      }
      traced("helexa_cpu::rotary_", helexa_cpu::rotary_, q, k, positions, cos_sin_);
      traced("helexa_cpu::kv_store", helexa_cpu::kv_store, k, v, layer.k_cache, layer.v_cache,
             slot_mapping);
      at::Tensor attended = at::empty({tokens, num_heads_, head_dim_}, hidden.options());
      traced("helexa_cpu::paged_decode_attention", helexa_cpu::paged_decode_attention, attended, q,
             layer.k_cache, layer.v_cache, block_tables, key_lens, token_rows, seq_rows, scale_);
      at::Tensor out = (*layer.o)(attended.view({tokens, q_size}));
      normed = at::empty_like(out);
      traced("helexa_cpu::fused_add_rms_norm", helexa_cpu::fused_add_rms_norm, normed, out, residual,
             layer.post_attention_norm, eps_, false);
      at::Tensor gate_up = (*layer.gate_up)(normed);
      at::Tensor activated = at::empty({tokens, gate_up.size(1) / 2}, gate_up.options());
      traced("helexa_cpu::silu_and_mul", helexa_cpu::silu_and_mul, activated, gate_up);
      hidden = (*layer.down)(activated);
    }
    at::Tensor out = at::empty_like(hidden);
    traced("helexa_cpu::fused_add_rms_norm", helexa_cpu::fused_add_rms_norm, out, hidden, residual, final_norm_,
           eps_, false);
    return out;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  // [tokens, heads, head_dim] -> each head normed on its own (a new tensor, as the Python form).
  at::Tensor norm_heads(const at::Tensor& x, const at::Tensor& weight) const {
    at::Tensor rows = x.reshape({-1, head_dim_});
    at::Tensor out = at::empty_like(rows, at::MemoryFormat::Contiguous);
    traced("helexa_cpu::rms_norm", helexa_cpu::rms_norm, out, rows, weight, eps_, false);
    return out.view(x.sizes());
  }

  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  at::Tensor embedding_, final_norm_, cos_sin_;
  std::vector<DecoderLayer> layers_;
};

TORCH_LIBRARY_FRAGMENT(helexa_cpu, m) {
  m.class_<CpuLinear>("CpuLinear")
      .def(torch::init<at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                       int64_t, int64_t>())
      .def("forward", [](const c10::intrusive_ptr<CpuLinear>& self, const at::Tensor& x) { return (*self)(x); });
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, at::Tensor, at::Tensor, at::Tensor>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("forward", &DecoderStack::forward)
      .def("num_layers", &DecoderStack::num_layers);
}
