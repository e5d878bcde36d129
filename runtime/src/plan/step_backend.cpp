#include "ctxplan/runtime/plan/step_backend.h"

#include "ctxplan/models/errors.h"

namespace ctxplan {

StepOutputs RunStep(const StepPlan& plan, const StepInputs& inputs, StepBackend& backend,
                    StepObserver* observer) {
  const int64_t n = plan.options().context_tokens;
  if (static_cast<int64_t>(inputs.tokens.size()) != n ||
      static_cast<int64_t>(inputs.labels.size()) != n)
    throw InputError("step inputs: " + std::to_string(inputs.tokens.size()) + " tokens and " +
                     std::to_string(inputs.labels.size()) + " labels for a context of " +
                     std::to_string(n) +
                     "; accepted: exactly one token and one label per position");
  const int64_t vocab = plan.model().vocab_size;
  for (const int32_t t : inputs.tokens)
    if (t < 0 || t >= vocab)
      throw InputError("step inputs: token id " + std::to_string(t) +
                       " is outside the vocabulary; accepted: 0 to " + std::to_string(vocab - 1));
  for (const int32_t l : inputs.labels)
    if (l >= vocab)
      throw InputError("step inputs: label " + std::to_string(l) +
                       " is outside the vocabulary; accepted: -1 (none) or 0 to " +
                       std::to_string(vocab - 1));
  backend.BeginStep(plan, inputs);
  Generator<Op> ops = plan.Ops();
  while (ops.Next()) {
    const Op& op = ops.Current();
    if (observer) observer->BeforeOp(op);
    backend.Execute(op);
    if (observer) observer->AfterOp(op);
  }
  return backend.EndStep();
}

}  // namespace ctxplan
